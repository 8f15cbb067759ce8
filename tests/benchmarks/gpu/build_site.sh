#!/bin/bash
# Local packaging (no GPU needed): vLLM 0.26.0 and the pure-Python dependencies the H200 image lacks, the
# gateway's own dependencies, the gateway's wheel, the tokenizer, redis-server; packed into parts that each fit
# one `run` call (at most 64 MiB travels per command, working tree included), staged under STAGE.
#   bash tests/benchmarks/gpu/build_site.sh [WORK] [STAGE]      (defaults /tmp/gpubuild and .cache/gpu)
# How the wheel list was resolved (uv pip compile of vLLM 0.26.0's requirements minus the image's packages and the
# heavy GPU extras Hopper does not need): requires-light.txt -> resolved-uv-compile.txt -> wheels-shipped.txt.
set -eu
G=$(cd "$(dirname "$0")" && pwd); REPO=$(cd "$G/../../.." && pwd)
W=${1:-/tmp/gpubuild}; STAGE=${2:-$REPO/.cache/gpu}
PY=${PY312:-python3.12}   # any CPython 3.12, only as the pip that installs for the image's 3.12 (pyenv: PY312=$(pyenv root)/versions/3.12.1/bin/python3.12)
mkdir -p $W/whl $W/gwdeps $W/tok
# 1. the ~80 wheels + vllm, each with the platform tag its file name carries (pip matches tags one at a time)
grep -o '^[^ ]*\.whl' $G/wheels-shipped.txt | grep -v '^vllm-' > $W/files.txt
echo vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl >> $W/files.txt
while read -r f; do
  base=${f%.whl}; IFS=- read -r name ver _ <<< "$base"; plat=${base##*-}; plat=${plat%%.*}
  [ -f $W/whl/$f ] && continue
  args=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d $W/whl)
  [ "$plat" != any ] && args+=(--platform "$plat")
  pip download -q "${args[@]}" "${name//_/-}==$ver"
done < $W/files.txt
# 2. the gateway's dependencies that neither the image nor vLLM's set has (pyproject.toml; kubernetes is optional)
for spec in litestar==2.25.0 litestar-htmx==0.5.0 faker==40.63.0 polyfactory==3.5.0 rich-click==1.9.9 \
            multipart==2.0.1 orjson==3.13.0 redis==8.1.0 hiredis==3.5.0 msgpack==1.2.4; do
  pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 -d $W/gwdeps $spec
done
# 3. install for 3.12, trim what Hopper does not use (FA2, the MoE ops, the Rust frontend, other Pythons' .so)
rm -rf $W/site; $PY -m pip install -q --no-index --no-deps --no-compile --target $W/site $W/whl/*.whl $W/gwdeps/*.whl
rm -rf $W/site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so $W/site/vllm/_moe_C_stable_libtorch.abi3.so $W/site/vllm/vllm-rs \
  $W/site/vllm/third_party/deep_gemm/_C.cpython-31[0134]-*.so
# 4. pack (xz -6: ~107 MB from ~520 MB) and split in two: the first 54,000,000 bytes, then the rest (a fixed
#    cut, so step 1 can start with part 1 while xz still writes part 2; each part then fits one command)
tar -C $W/site -cf - . | xz -6 -T0 > $W/site.tar.xz
head -c 54000000 $W/site.tar.xz > $W/site.tar.xz.part00; tail -c +54000001 $W/site.tar.xz > $W/site.tar.xz.part01
sha256sum < $W/site.tar.xz | cut -d' ' -f1 > $G/site.sha256
# 5. the tokenizer (the tiny test model's byte-level BPE padded to Qwen3's 151,936 ids) and Debian's redis-server
${PY_TOK:-$REPO/.venv-vllm/bin/python} $G/extend_tokenizer.py $REPO/.cache/models/tiny $W/tok   # needs `tokenizers`
mkdir -p $W/redis/lib; cp /usr/bin/redis-server $W/redis/
for l in liblzf.so.1 libjemalloc.so.2 libsystemd.so.0 libssl.so.3 libcrypto.so.3 libatomic.so.1 libcap.so.2 \
         libgcrypt.so.20 libgpg-error.so.0 liblz4.so.1 libzstd.so.1 liblzma.so.5; do cp -L /lib/x86_64-linux-gnu/$l $W/redis/lib/; done
tar -C $W/redis -cJf $W/redis.tar.xz .
# 6. stage: s = scripts + the gateway's wheel (every step), p1/p2 = the parts (steps 1 and 2), x = tokenizer + redis (step 1)
rm -rf $STAGE/s $STAGE/p1 $STAGE/p2 $STAGE/x; mkdir -p $STAGE/s $STAGE/p1 $STAGE/p2 $STAGE/x/tok
(cd $REPO && pip wheel -q --no-deps -w $STAGE/s .)
cp $G/*.sh $G/*.py $G/site.sha256 $STAGE/s/
cp $W/site.tar.xz.part00 $STAGE/p1/; cp $W/site.tar.xz.part01 $STAGE/p2/
cp $W/tok/* $STAGE/x/tok/; cp $W/redis.tar.xz $STAGE/x/
du -sh $STAGE/*
