"""`--write-cap`: one value changes; comments, order, quoting and layout of the policy file stay."""

import os
import stat

import pytest
import yaml

from policies.capfile import CapFileError, set_cap, write_cap
from policies.config import parse_policy

POLICY = """\
# Production policy: reviewed by ops, keep the comments.
listen:
  host: 0.0.0.0   # behind the load balancer
  port: 8080

models:
    - name: qwen3-4b            # public name
      served_name: "Qwen/Qwen3-4B"
      backends:
        -   url: http://10.0.0.11:8000   # rack 1
            name: gpu-a
        # the second replica has no name: it is qwen3-4b-1
        -   url: 'http://10.0.0.12:8000'
            served_name: qwen
            cap: 16   # measured 2025-01
    - name: embed
      backends: [{url: "http://127.0.0.1:8001", name: emb}]   # flow style
# trailing comment
"""


def changed_lines(before: str, after: str) -> tuple[list[str], list[str]]:
    b, a = before.splitlines(), after.splitlines()
    return [line for line in b if line not in a], [line for line in a if line not in b]


def test_new_cap_is_one_added_line_at_the_backends_indentation():
    after = set_cap(POLICY, "gpu-a", 32)
    assert changed_lines(POLICY, after) == ([], ["            cap: 32"])
    lines = after.splitlines()
    assert lines[lines.index("            name: gpu-a") + 1] == "            cap: 32"
    policy = parse_policy(after)
    assert policy.models[0].backends[0].cap == 32
    assert policy.models[0].backends[1].cap == 16


def test_existing_cap_is_replaced_in_place_keeping_its_comment():
    after = set_cap(POLICY, "qwen3-4b-1", 64)  # the unnamed second backend: <model>-<index>
    assert changed_lines(POLICY, after) == (["            cap: 16   # measured 2025-01"],
                                            ["            cap: 64   # measured 2025-01"])


def test_flow_mapping_gets_the_key_inline():
    after = set_cap(POLICY, "emb", 8)
    assert changed_lines(POLICY, after)[1] == [
        '      backends: [{url: "http://127.0.0.1:8001", name: emb, cap: 8}]   # flow style']
    assert parse_policy(after).models[1].backends[0].cap == 8


def test_key_order_and_everything_else_survive():
    after = set_cap(POLICY, "gpu-a", 32)
    before_data, after_data = yaml.safe_load(POLICY), yaml.safe_load(after)
    after_data["models"][0]["backends"][0].pop("cap")
    assert after_data == before_data
    assert list(yaml.safe_load(after)["models"][0]["backends"][0]) == ["url", "name", "cap"]
    assert after.count("#") == POLICY.count("#")
    assert after.endswith("# trailing comment\n")


def test_file_is_replaced_atomically_with_its_mode_and_crlf_kept(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_bytes(POLICY.replace("\n", "\r\n").encode())
    os.chmod(path, 0o640)
    assert write_cap(path, "gpu-a", 24) is None
    assert write_cap(path, "qwen3-4b-1", 12) == 16
    data = path.read_bytes()
    assert data.count(b"\r\n") == POLICY.count("\n") + 1 and b"\n" not in data.replace(b"\r\n", b"")
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["policy.yaml"]  # no temp file left behind
    policy = parse_policy(data.decode())
    assert [b.cap for b in policy.models[0].backends] == [24, 12]


def test_a_symlinked_policy_file_is_written_through_the_link(tmp_path):
    real = tmp_path / "real.yaml"
    real.write_text(POLICY)
    link = tmp_path / "policy.yaml"
    link.symlink_to(real)
    write_cap(link, "gpu-a", 4)
    assert link.is_symlink() and "cap: 4" in real.read_text()


def test_last_line_without_newline(tmp_path):
    text = "models:\n  - name: m\n    backends:\n      - url: http://h:1"
    after = set_cap(text, "m-0", 3)
    assert after == text + "\n        cap: 3\n"


def test_unknown_backend_is_an_error_naming_the_known_ones(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    with pytest.raises(CapFileError) as err:
        write_cap(path, "gpu-z", 8)
    assert "gpu-z" in str(err.value) and "gpu-a, qwen3-4b-1, emb" in str(err.value)
    assert path.read_text() == POLICY


@pytest.mark.parametrize("cap", [0, -1, 100_001])
def test_an_invalid_result_is_refused_and_the_file_untouched(tmp_path, cap):
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    with pytest.raises(CapFileError):
        write_cap(path, "gpu-a", cap)
    assert path.read_text() == POLICY


def test_an_invalid_policy_file_is_left_alone(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY.replace("port: 8080", "port: 8080\n  colour: blue"))
    with pytest.raises(CapFileError, match="not valid as it is"):
        write_cap(path, "gpu-a", 8)


def test_anchored_backends_are_refused_rather_than_edited_twice():
    text = ("models:\n  - name: a\n    backends:\n      - &b {url: 'http://h:1', name: x}\n"
            "  - name: b\n    backends:\n      - *b\n")
    with pytest.raises(CapFileError):  # both models would name their backend x: invalid before any edit
        set_cap(text, "x", 8)
    text = ("models:\n  - name: a\n    backends:\n      - &b {url: 'http://h:1'}\n"
            "  - name: b\n    backends:\n      - *b\n")
    with pytest.raises(CapFileError, match="by hand"):
        set_cap(text, "a-0", 8)
