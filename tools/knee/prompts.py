"""Synthetic prompts of a chosen length that never share a prefix.

vLLM's prefix cache hashes a prompt's KV blocks as a chain from the first token, so two prompts that differ
in their first block share nothing. Every prompt here starts with a run id and a request number, which puts
a difference into the first block (the chat template adds only a few tokens before it): no request of a
sweep, or of an earlier sweep on the same server, skips prefill. The words after it are drawn from a small
vocabulary with a per-request seed, so the text is not one repeated phrase either.

How many tokens a word makes depends on the tokenizer; the sweep calibrates the word count against the
server's own usage.prompt_tokens (see sweep.calibrate).
"""

from __future__ import annotations

import random
import secrets

WORDS = (
    "about above across after again against along also always among answer around asked away back because "
    "become before began behind being below between both bring build called came carry change city close "
    "come could country cover cross during early earth enough even every example face family far father "
    "feet field find first follow food form found four friend from full gave give good great green ground "
    "group grow hand hard head hear heard help here high home house idea important inside island keep kind "
    "land large last later learn leave left letter life light line list little live long look made make many "
    "mark might mile miss money more morning most mother mountain move much music must name near need never "
    "next night north nothing notice number often once only open order other over paper part people picture "
    "place plant point press problem question quick rain read really record river road rock room round run "
    "said same school science second seem sentence several short should show side since small song sound "
    "south space stand start state still stone story street strong study such summer sure table take talk "
    "tell than their them then there these thing think those thought three through time together took tree "
    "true turn under until upon usual very voice walk want watch water weather week well went were west what "
    "when where which while white whole wind winter with without word work world would write year young"
).split()


class PromptMaker:
    """Makes the n-th prompt of a sweep: unique head, then `words` pseudo-random words."""

    def __init__(self, words: int, seed: int = 0):
        self.words = max(1, words)
        self.seed = seed
        self.run_id = secrets.token_hex(4)  # new per sweep, so a rerun on the same server is not cached
        self.count = 0

    def next(self) -> str:
        self.count += 1
        rng = random.Random(self.seed * 1_000_003 + self.count)
        body = " ".join(rng.choices(WORDS, k=self.words))
        return f"{self.run_id}-{self.count} {body}"
