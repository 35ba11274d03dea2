#!/usr/bin/env bash
# The NCCL test suite and the GPU benchmarks, as run on the lent GPU machine (see docs/benchmarks.md).
#
#   benchmarks/device_suite.sh OUT_DIR [tests] [bench] [autotune] [twonode] [twobytwo] [autonv] [cache] [cpuauto]
#                              [kernels] [onerank] [cachedecode]
#
# Environment: NGPU (ranks; default every GPU, e.g. NGPU=2 with CUDA_VISIBLE_DEVICES=0,1),
# AUTOTUNE_ARGS (extra arguments for autotune_training.py), PYTEST_K (a -k filter for tests),
# TEST_TIMEOUT_S / TESTS_DEADLINE_S (tests: the limit of one test, default 150 s, and of the part, 540 s),
# RATE (twonode: the link, tc syntax, default 10gbit), TWONODE_ARGS (arguments of allreduce_vs_ddp.py there).
#
# twonode: every GPU is its own "node" (one torchrun --nnodes NGPU --node_rank i each), NCCL is forced onto
# TCP sockets over loopback and the loopback link is shaped with tc's token bucket to RATE, so the network
# is the bottleneck as on a 10-25 Gbit/s cluster. Both directions share the one qdisc of `lo`. The GPU
# machine has no tc: carry it with `benchmarks/carry_binaries.sh tc` (then carry=[".bin", ...]).
#
# The GPU machine has torch, lightning and grpcio but not the project, grpcio-health-checking,
# grpcio-reflection or redis-py: wheels for those are carried in .whl/ (git-ignored) and the package is
# put on PYTHONPATH through .ci/linktree. NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
#
# twobytwo (4 GPUs): two torchrun "nodes" of 2 GPUs each. Inside a node NCCL uses NVLink/P2P; between the
# nodes NCCL sockets over `lo`, shaped to RATE as for twonode: each node has its own NCCL_HOSTID, so NCCL sees
# two hosts (no P2P or SHM between them). NCCL_DEBUG=INFO goes to files under /tmp; the transport of every
# channel connection (P2P inside a node, NET/Socket between) is counted per rank pair kind and written into
# twobytwo.log. TWOBYTWO_MODELS, TWOBYTWO_ROUNDS and TWOBYTWO_VARIANTS override the defaults below.
# autonv: the same variants on every GPU over NVLink (one node): auto against its choice and the best.
#
# cache and cpuauto use the host's CPUs only (a quiet 16-core machine): keyed vs unkeyed cache reads
# (redis-server carried in .bin/), and algorithm="auto" on two CPU ranks in network namespaces at 1 Gbit/s
# (ip and tc carried in .bin/; CPU_MODELS picks the models, default mlp). CACHE_ARGS: more arguments of
# cache_throughput.py there (e.g. --profile 3: where the reading thread's time goes).
#
# kernels: compression_kernels.py on one GPU, KERNELS_ARGS its arguments (default: buckets of 1/25/100/420 MiB);
# onerank: one_rank.py --device cuda (BaguaStrategy against Lightning's single-device strategy), ONERANK_ARGS
# more arguments; cachedecode: cache_decode.py --profile (decoding alone, sealed against unkeyed, host CPUs).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: device_suite.sh OUT_DIR [tests] [bench] [autotune]}; shift
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$(.ci/linktree)${PYTHONPATH:+:$PYTHONPATH}"
ngpu=${NGPU:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpus.txt"
rc=0
for what in "$@"; do
  case "$what" in
    tests)
      # A per-test limit (pytest-timeout) and one for the whole part: timeout signals its whole process
      # group, so ranks a stuck test left behind go with it.
      timeout -k 10 "${TESTS_DEADLINE_S:-540}" python3 -m pytest -m gpu -q -p no:cacheprovider \
        --timeout "${TEST_TIMEOUT_S:-150}" tests/engine tests/strategy tests/torch_api tests/contrib -rs ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 \
        | tee "$out/nccl_tests.log"
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1
      # The launched jobs' own logs say where a failed or stuck rank was.
      for f in /tmp/pytest-of-*/pytest-*/*/cmd*.log; do
        [ -f "$f" ] && { echo "== $f"; tail -n 40 "$f"; }
      done >> "$out/nccl_tests.log" 2>/dev/null ;;
    bench)
      torchrun --nproc_per_node "$ngpu" benchmarks/allreduce_vs_ddp.py --steps 25 --rounds 8 \
        --variants ddp,gradient_allreduce,gradient_allreduce+25MiB,bytegrad,decentralized,low_precision_decentralized \
        --json "$out/allreduce_vs_ddp_${ngpu}gpu.json" 2>&1 | tee "$out/allreduce_vs_ddp_${ngpu}gpu.log" || rc=1 ;;
    autotune)
      torchrun --nproc_per_node "$ngpu" benchmarks/autotune_training.py ${AUTOTUNE_ARGS:-} 2>&1 \
        | tee "$out/autotune_training_${ngpu}gpu.log" || rc=1 ;;
    twonode)
      tc=.bin/tc; [ -x "$tc" ] || tc=$(command -v tc) || { echo "twonode: no tc; run benchmarks/carry_binaries.sh tc"; rc=2; continue; }
      "$tc" qdisc replace dev lo root tbf rate "${RATE:-10gbit}" burst 8mb latency 50ms || { rc=1; continue; }
      pids=()
      for ((r = 0; r < ngpu; r++)); do
        CUDA_VISIBLE_DEVICES=$r NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo \
        NCCL_IB_DISABLE=1 torchrun --nnodes "$ngpu" --node_rank "$r" --nproc_per_node 1 --master_addr 127.0.0.1 \
          --master_port 29555 benchmarks/allreduce_vs_ddp.py ${TWONODE_ARGS:---model resnet50} \
          --json "$out/twonode_${r}.json" > "$out/twonode_rank${r}.log" 2>&1 &
        pids+=($!)
      done
      for p in "${pids[@]}"; do wait "$p" || rc=1; done
      "$tc" qdisc del dev lo root || true
      cat "$out/twonode_rank0.log" ;;
    twobytwo)
      tc=.bin/tc; [ -x "$tc" ] || tc=$(command -v tc) || { echo "twobytwo: no tc; run benchmarks/carry_binaries.sh tc"; rc=2; continue; }
      [ "$ngpu" -ge 4 ] || { echo "twobytwo: needs 4 GPUs, found $ngpu"; rc=2; continue; }
      "$tc" qdisc replace dev lo root tbf rate "${RATE:-10gbit}" burst 8mb latency 50ms || { rc=1; continue; }
      log="$out/twobytwo.log"; nccl=/tmp/twobytwo_nccl; rm -rf "$nccl"; mkdir -p "$nccl"
      { echo "twobytwo: $(date -u +%FT%TZ), lo shaped to ${RATE:-10gbit} ($("$tc" qdisc show dev lo))"; } > "$log"
      pids=()
      for n in 0 1; do
        CUDA_VISIBLE_DEVICES=$((2 * n)),$((2 * n + 1)) NCCL_HOSTID="twobytwo-node$n" NCCL_NET=Socket \
        NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P,NET \
        NCCL_DEBUG_FILE="$nccl/node$n.%p.log" timeout "${TWOBYTWO_TIMEOUT:-360}" \
        torchrun --nnodes 2 --node_rank "$n" --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29556 \
          benchmarks/allreduce_vs_ddp.py --model "${TWOBYTWO_MODELS:-resnet50,100m,vgg16}" \
          --rounds "${TWOBYTWO_ROUNDS:-14}" --warmup 2 --auto-warmup 2 --auto-trials 6 \
          --variants "${TWOBYTWO_VARIANTS:-ddp,gradient_allreduce,bytegrad,bytegrad:hierarchical=0,decentralized,low_precision_decentralized,auto:gradient_allreduce+bytegrad+decentralized+low_precision_decentralized}" \
          --json "$out/twobytwo.json" > "$out/twobytwo_node$n.log" 2>&1 &
        pids+=($!)
      done
      for p in "${pids[@]}"; do wait "$p" || rc=1; done
      "$tc" qdisc del dev lo root || true
      {
        echo "== NCCL transports (channel connections in NCCL_DEBUG=INFO, all communicators; node = NCCL_HOSTID)"
        for f in "$nccl"/node*.log; do
          [ -f "$f" ] || continue
          echo "$(basename "$f"): hostid $(grep -m1 -o 'NCCL_HOSTID set by environment to [^ ]*' "$f" | awk '{print $NF}')," \
            "P2P $(grep -c 'via P2P' "$f"), NET/Socket $(grep -c 'via NET/Socket' "$f"), SHM $(grep -c 'via SHM' "$f")"
        done
        echo "== examples"
        cat "$nccl"/node*.log 2>/dev/null | grep -m3 'via P2P'
        cat "$nccl"/node*.log 2>/dev/null | grep -m3 'via NET/Socket'
        echo "== node 0"; cat "$out/twobytwo_node0.log"
      } >> "$log"
      cat "$log" ;;
    autonv)
      timeout "${AUTONV_TIMEOUT:-580}" torchrun --nproc_per_node "$ngpu" benchmarks/allreduce_vs_ddp.py \
        --model "${AUTONV_MODELS:-resnet50,100m,vgg16}" --rounds "${AUTONV_ROUNDS:-300}" --warmup 3 \
        --auto-warmup 2 --auto-trials 12 \
        --variants "ddp,gradient_allreduce,bytegrad,decentralized,low_precision_decentralized,auto:gradient_allreduce+bytegrad+decentralized+low_precision_decentralized" \
        --json "$out/autonv_${ngpu}gpu.json" 2>&1 | tee "$out/autonv_${ngpu}gpu.log" || rc=1 ;;
    cache)
      PATH="$PWD/.bin:$PATH" python3 benchmarks/cache_throughput.py --variants c,k --repeats 15 ${CACHE_ARGS:-} 2>&1 \
        | tee "$out/cache_keyed.log" || rc=1 ;;
    cpuauto)
      PATH="$PWD/.bin:$PATH" python3 benchmarks/switch_diagnose.py --netns --embed-std 1 2>&1 \
        | tee "$out/switch_diagnose_old_init.log" || rc=1
      for model in ${CPU_MODELS:-mlp}; do
        PATH="$PWD/.bin:$PATH" python3 benchmarks/allreduce_vs_ddp.py --netns --rate 1gbit --model "$model" \
          --rounds 30 --variants gradient_allreduce,bytegrad,auto 2>&1 | tee "$out/cpuauto_${model}.log" || rc=1
      done ;;
    kernels)
      python3 benchmarks/compression_kernels.py ${KERNELS_ARGS:---sizes 1,25,100,420} \
        --json "$out/compression_kernels.json" 2>&1 | tee "$out/compression_kernels.log" || rc=1 ;;
    onerank)
      python3 benchmarks/one_rank.py --device cuda ${ONERANK_ARGS:-} --json "$out/one_rank.json" 2>&1 \
        | tee "$out/one_rank.log" || rc=1 ;;
    cachedecode)
      python3 benchmarks/cache_decode.py --profile ${CACHEDECODE_ARGS:-} 2>&1 | tee "$out/cache_decode.log" || rc=1 ;;
    *) echo "unknown part $what"; rc=2 ;;
  esac
done
exit $rc
