#!/usr/bin/env bash
# The GPU benchmark session: run on the 2 x H200 machine from the repo root.
#   bash bench/gpu.sh [main-job|nsys|plan|zero|pipe|pipe-bf16|pipe-masters|pipe-gaps|tensor|comm|precision|train|hybrid|hf|
#                      zero3-pipe (4 GPUs: ZeRO-3 x pipe 2 x data 2 beside torch pipelining + fully_shard)|
#                      profile|trace|smoke|offload|offload-big|offload-test|split-backward|data|speed|speed-profile|speed-more|
#                      tp-dispatch|attention|float8|float8-more|float8-init|grad-sums-hf|grad-sums-gpt|grad-fusion|autotune|
#                      main-resume|gpu-tests|moe|moe-more|alst-8b|alst-tiny|long-kit|long-kit-compiled|long-8b|long-1m|long-512k|long-128k|varlen-test|docatt|moe-core|moe-why|
#                      seq-multi|seq-multi-alst|seq-multi-pipe|seq-multi-longest|moe-multi|moe-multi-titan|moe-multi-pipe|
#                      moe-multi-overlap|moe-multi-pairs ...]
#   moe-multi*: issue 49 on every GPU of the machine (2, 4 or 8), bench/moe.py --nproc N, a Qwen3-30B-A3B-shaped MoE of
#   6 x N layers (48 on 8), ZeRO-3, each run its own processes and time limit: moe-multi expert parallel N beside dense
#   data parallel (compiled layers), moe-multi-titan torchtitan 0.3.0's expert parallel beside ours eager, moe-multi-pipe
#   pipe 2 x expert N/2 under DualPipeV and 1F1B (the all-to-all hidden; 4+ GPUs for an expert axis), moe-multi-overlap
#   expert parallel N with the all-to-all in two halves behind the experts beside without (its "a2a hidden"),
#   moe-multi-pairs pipe 2 x expert N/2 under DualPipeV with its pairs in turns beside without, eager; carry .whl
#   (transformers 5.25.0, torchtitan 0.3.0 and its needs, as for moe).
#   offload: ZeRO-Offload on one GPU beside DeepSpeed (1.3B GPT, 65,536 tokens/step); offload-big: a 4.3B GPT
#   under a 16 GiB GPU memory cap, ZeRO-3 with both offloads (tokens/s, GPU and host peak);
#   speed: issue 31 on 1 GPU: HF Llama (TinyLlama's shape) and the 1.34B GPT, plain PyTorch eager / compiled
#   beside pipezero eager / compiled layers + fused loss (needs transformers: carry its wheel in .whl).
#   offload-test: the offload tests that need CUDA (streams, pinned buffers, parameters off the GPU).
#   alst-8b / alst-tiny: bench/long_context.py beside DeepSpeed ALST (Llama-3-8B's width at 8 layers, 512K
#   tokens, optimizer on the host, DeepSpeed's CPU Adam JIT-built in the first alst run's set-up; TinyLlama's
#   shape at 128K and 512K); needs transformers and deepspeed in .whl.
#   seq-multi*: issue 48 on every GPU of the machine (2, 4 or 8), bench/sequence_scaling.py, one 600-s call each:
#   seq-multi: Ulysses 2/4/8 beside data parallel (Llama-3-8B's width at 8 layers, 64K tokens a row, ZeRO-3) and
#   DeepSpeed ALST at each degree; seq-multi-alst: ALST's rows alone (if seq-multi's time ran out before them);
#   seq-multi-pipe: pipe 2 (x sequence 2 on 4 and 8) under ZB-V and DualPipeV; seq-multi-longest: the whole 8B,
#   one row of 128K / 256K / 512K tokens until one does not train; deepspeed and transformers in .whl.
#   (default: main-job smoke zero pipe comm precision; profile/trace: kernel tables and chrome traces under $OUT)
#   main-job: the README's main job on 1 GPU and on 2 when present, failing unless every parameter and
#   activation is on CUDA (--expect-device cuda); nsys: 2 steps of it under Nsight Systems with NVTX ranges.
# The GPU image has torch but not this package installed: import it through a link.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/pz && ln -sfn "$PWD" /tmp/pz/pipezero
export PYTHONPATH=/tmp/pz:$PWD
if ls .whl/*.whl >/dev/null 2>&1; then  # the bench-only peers: `bash bench/wheels.sh` fetches them; carry .whl
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
out=${OUT:-/tmp/out}; mkdir -p "$out"
gpt=(--layers 24 --d-model 2048 --heads 16 --seq 2048 --vocab 32000)
run() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log" | grep -v "^\s*$" | tail -40
  echo "=== $name exit ${PIPESTATUS[0]}"
}
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
main_job() {  # name, GPUs, seconds, extra flags...: examples/train_gpt.py as the README runs it, on CUDA
  local name=$1 n=$2 limit=$3; shift 3
  run "$name" "$limit" python3 -m torch.distributed.run --standalone --nproc-per-node "$n" examples/train_gpt.py \
    --pipe "$n" --out "/tmp/$name" --save-interval 100000 --eval-interval 100000 --expect-device cuda "$@"
  grep -E "device check|tok/s|Error" "$out/$name.log" | tail -8
}
big=(--precision bf16 --layers 8 --d-model 512 --heads 8 --seq-len 512)  # issue 14's shape
what=${*:-main-job smoke zero pipe comm precision}
for w in $what; do
  case $w in
    main-job) for n in 1 2; do
                [ "$n" -le "$ngpu" ] || continue
                main_job "main-job-${n}gpu" "$n" 240 --steps 20 --steps-per-print 5
                main_job "main-job-${n}gpu-bf16" "$n" 300 "${big[@]}" --steps 60 --steps-per-print 20
              done
              run generate 120 python3 examples/generate.py --checkpoint /tmp/main-job-1gpu-bf16 --tokens 200 ;;
    nsys) if command -v nsys >/dev/null; then
            run nsys 300 env PIPEZERO_NVTX=1 nsys profile --trace cuda,nvtx --force-overwrite true \
              --output "$out/main-job" python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
              examples/train_gpt.py --pipe 1 "${big[@]}" --steps 2 --out /tmp/nsys-job --expect-device cuda
            run nsys-nvtx 120 nsys stats --report nvtx_sum --format csv "$out/main-job.nsys-rep"
          else echo "=== nsys: not installed (Nsight Systems), skipped"; fi ;;
    smoke) nvidia-smi --query-gpu=name,memory.total --format=csv
           python3 -c "import torch; print(torch.__version__, torch.cuda.device_count())" ;;
    zero) run zero 480 python3 bench/zero.py --device cuda --profile "$out/profile" ;;
    zero3-pipe) [ "$ngpu" -ge 4 ] || { echo "=== zero3-pipe: needs 4 GPUs, $ngpu here"; continue; }
                run zero3-pipe 480 python3 bench/zero3_pipe.py --device cuda "${gpt[@]}" --batch 32 --microbatches 8 ;;
    pipe) run pipe 420 python3 bench/pipe.py --device cuda --world 2 "${gpt[@]}" --batch 32 --microbatches 8 --steps 5 \
            --partition measured --trace "$out/trace" ;;
    split-backward) run split-backward 120 python3 bench/split_backward.py --device cuda --layers 6 --d-model 2048 \
                      --heads 16 --seq 2048 --microbatch 1 2 4 ;;  # zero-bubble's I + W vs B on one chunk
    pipe-bf16) run pipe-bf16 420 python3 bench/pipe.py --device cuda --world 2 "${gpt[@]}" --batch 32 --microbatches 8 \
                 --steps 5 --precision bf16 --partition measured ;;
    tensor) run tensor 270 python3 bench/tensor.py --device cuda "${gpt[@]}" --batch 32 --microbatches 8 ;;
    comm) run comm 120 python3 bench/comm.py --device cuda ;;
    tp-dispatch) i=0; for shape in "--d-model 64 --heads 4 --seq 32 --batch 2" "--d-model 256 --heads 4 --seq 128 --batch 4" \
                              "--d-model 2048 --heads 16 --seq 2048 --batch 1 --dtype bfloat16"; do
                   for c in "" --compile; do  # issue 31: plain vs DTensor vs local-tensor Block on a one-rank mesh
                     i=$((i + 1)); run tp-dispatch-$i 180 python3 bench/tp_dispatch.py --device cuda $shape $c --rounds 21 --repeats 20
                   done
                 done ;;
    attention) run attention 200 python3 bench/attention.py --device cuda ;;  # issue 31: SDPA kernels, Llama/GPT shapes
    plan) run plan 420 python3 bench/plan.py --device cuda --steps 3 ;;  # planner: predicted vs measured (1 GPU: 8 layouts, ~6 min)
    precision) run precision 120 python3 bench/precision.py --device cuda ;;
    train) run train 300 python3 bench/train.py --device cuda --world 2 ;;
    hybrid) run hybrid 300 python3 bench/hybrid.py --device cuda ;;
    offload) run offload 480 python3 bench/zero.py --device cuda --nproc 1 --vocab 32000 --batch 4 --accum 8 --steps 3 \
               --adam fused --runs pipezero-1 pipezero-1-offload pipezero-1-offload-dpu pipezero-3-offload \
               deepspeed-1-offload deepspeed-3-offload ;;
    offload-big) run offload-big 480 python3 bench/zero.py --device cuda --nproc 1 --memory-cap-gib 16 --layers 20 \
                   --hidden 4096 --heads 32 --vocab 32000 --seq 2048 --batch 1 --accum 1 --steps 3 --adam fused \
                   --runs pipezero-3-offload ;;  # DeepSpeed's host peak at this size exceeds a 128 GiB box (RESULTS)
    main-resume) main_job main-resume 1 150 --steps 20 --steps-per-print 10 --save-interval 10  # then resumed
                 main_job main-resume 1 150 --steps 30 --steps-per-print 10 --save-interval 10 --resume
                 run generate-resume 90 python3 examples/generate.py --checkpoint /tmp/main-resume --tokens 60 ;;
    gpu-tests) run gpu-tests 240 python3 -m pytest -q -p no:cacheprovider tests/test_hf_generate.py \
                 tests/test_generate_static.py tests/test_zero_offload.py tests/test_state_hand.py ;;  # CUDA cases too
    offload-test) run offload-test 240 python3 -m pytest -q -p no:cacheprovider tests/test_zero_offload.py -k cuda ;;
    hf) run hf 540 python3 bench/hf.py --device cuda ;;  # needs transformers (carry its wheels in .whl)
    moe) run moe 560 python3 bench/moe.py --timeout 150 \
           --runs pipezero pipezero-compiled hf-grouped_mm-compiled torchtitan-compiled ;;  # issue 47; .whl
    moe-core) run moe-core 290 python3 bench/moe.py --timeout 140 --runs pipezero-compiled hf-grouped_mm-compiled ;;
    moe-why) run moe-why 390 python3 bench/moe.py --timeout 190 --runs pipezero-compiled hf-grouped_mm-compiled \
               --explain "$out/moe-why" ;;  # moe-core, then each run's peak by place and kernel table
    moe-more) run moe-more 560 python3 bench/moe.py --timeout 200 \
                --runs hf-grouped_mm-compiled hf-grouped_mm torchtitan hf-eager hf-batched_mm hf-sonicmoe \
                hf-deepgemm ;;
    moe-multi|moe-multi-titan|moe-multi-pipe|moe-multi-overlap|moe-multi-pairs)  # issue 49: two runs a case, 270 s each
      [ "$ngpu" -ge 2 ] || { echo "=== $w: needs 2+ GPUs, $ngpu here"; continue; }
      case $w in moe-multi) runs="expert-compiled dense-compiled" ;; moe-multi-titan) runs="torchtitan-compiled expert" ;;
                 moe-multi-pipe) runs="dualpipev-compiled 1f1b-compiled" ;;
                 moe-multi-overlap) runs="expert-overlap-compiled expert-compiled" ;;
                 moe-multi-pairs) runs="dualpipev-pairs dualpipev" ;; esac  # eager both: pairs refuse compile
      run "$w" 570 python3 bench/moe.py --nproc "$ngpu" --timeout 270 --runs $runs ;;
    alst-8b) run alst-8b 570 env DS_SKIP_CUDA_CHECK=1 python3 bench/long_context.py --shape llama3-8b --layers 8 --steps 1 \
               --runs alst pipezero-offload --lengths 524288 ;;  # issue 45 beside ALST (deepspeed in .whl)
    varlen-test) python3 -c "import inspect, torch.nn.attention.varlen as v; print(inspect.signature(v.varlen_attn))"
                 run varlen-test 60 python3 -m pytest -q -p no:cacheprovider tests/test_long_context.py -k varlen ;;
    docatt) run docatt 100 python3 bench/document_attention.py --device cuda --lengths 131072 524288 --rounds 3 ;;  # one varlen call vs a loop
    long-kit) run long-kit 300 python3 bench/long_context.py --shape tinyllama --steps 3 --profile "$out/long-kit" \
                --runs pipezero pipezero-selective pipezero-full pipezero-offload --lengths 32768 ;;  # kit's cost
    long-kit-compiled) run long-kit-compiled 480 python3 bench/long_context.py --shape tinyllama --steps 2 \
                         --runs pipezero-whole-compiled pipezero-compiled pipezero-full-compiled \
                         pipezero-offload-compiled --lengths 32768 ;;  # the kit's cost, layers and loss compiled
    long-8b) run long-8b 570 python3 bench/long_context.py --shape llama3-8b --steps 0 --offload-optimizer off \
               --offload-layers 26 --runs pipezero-offload --lengths 524288 ;;  # the whole 8B at 512K: bf16 AdamW
               # on the GPU, the first 26 layers' inputs on the host (the embedding's ids and 25 decoder layers':
               # 100 GiB + the process); the planner's model of it: 113.6 GiB on the device. An H200 only
               # (run's needs_h200)
    long-128k) run long-128k 80 python3 bench/long_context.py --shape tinyllama --steps 1 --runs pipezero-offload \
                 --lengths 131072 ;;
    long-1m) run long-1m 240 python3 bench/long_context.py --shape tinyllama --steps 0 --runs pipezero-offload \
               --lengths 1048576 ;;  # one 1M-token step, after a 4K one (the AdamW state)
    long-512k) run long-512k 300 env DS_SKIP_CUDA_CHECK=1 python3 bench/long_context.py --shape tinyllama --steps 1 \
                 --runs pipezero-offload alst --lengths 524288 ;;  # beside DeepSpeed ALST (deepspeed in .whl)
    seq-multi) run seq-multi 570 env DS_SKIP_CUDA_CHECK=1 python3 bench/sequence_scaling.py --cases sequence \
                 --layers 8 --one-launch --timeout 150 --save "$out/seq-multi.json" ;;  # issue 48
    seq-multi-alst) run seq-multi-alst 570 env DS_SKIP_CUDA_CHECK=1 python3 bench/sequence_scaling.py --cases sequence \
                      --layers 8 --only alst-2 alst-4 alst-8 --timeout 180 ;;
    seq-multi-pipe) run seq-multi-pipe 570 python3 bench/sequence_scaling.py --cases pipe --layers 8 --one-launch \
                      --timeout 130 ;;
    seq-multi-longest) run seq-multi-longest 570 python3 bench/sequence_scaling.py --cases longest \
                         --lengths 131072 262144 524288 --timeout 260 ;;  # one step each, the whole 8B
    alst-tiny) run alst-tiny 560 python3 bench/long_context.py --shape tinyllama --steps 1 --runs alst \
                 --lengths 131072 524288 ;;
    data) run data 600 python3 bench/data.py --device cuda --hf-layers 22 --hidden 2048 --seq-len 2048 --batch 8 \
            --max-docs 400 --workers 8 ;;  # the loader's share of a 1.1B Llama step (needs transformers)
    speed) run speed-hf 300 python3 bench/hf.py --device cuda --nproc 1 --steps 3 --runs torch-compiled \
             pipezero-1-compile pipe-1f1b-compile pipe-1f1b-fast pipe-1f1b
           run speed-gpt 220 python3 bench/train.py --device cuda --world 1 --layers 24 --d-model 2048 --heads 16 \
             --seq-len 2048 --vocab 32000 --global-batch 32 --micro-batches 8 --steps 5 --warmup 2 \
             --runs torch-compiled pipezero-1-compile pipezero-1-fast  # issue 31, 1 GPU (needs transformers)
           for b in 1 4; do
             run tp-dispatch-batch$b 40 python3 bench/tp_dispatch.py --device cuda --d-model 2048 --heads 16 --seq 2048 \
               --batch $b --dtype bfloat16 --rounds 11 --repeats 10
           done ;;
    float8) for f in "" "--float8 tensorwise"; do  # issue 31: fp8 Linears (torchao; carry its wheel in .whl)
              run "float8-hf${f:+-fp8}" 300 python3 bench/hf.py --device cuda --nproc 1 --steps 3 --runs torch-compiled \
                pipe-1f1b-compile pipezero-1-compile $f
              run "float8-gpt${f:+-fp8}" 300 python3 bench/train.py --device cuda --world 1 "${gpt[@]/--seq/--seq-len}" \
                --global-batch 32 --micro-batches 8 --steps 5 --warmup 2 --runs torch-compiled pipezero-1-compile $f
            done ;;
    float8-more) main_job main-job-bf16 1 300 "${big[@]}" --steps 60 --steps-per-print 20  # fp8's loss beside bf16's
                 main_job main-job-fp8 1 300 "${big[@]}" --steps 60 --steps-per-print 20 --float8 tensorwise
                 run float8-hf-rowwise 300 python3 bench/hf.py --device cuda --nproc 1 --steps 3 --runs torch-compiled \
                   pipezero-1-compile --float8 rowwise
                 run float8-gpt-rowwise 300 python3 bench/train.py --device cuda --world 1 "${gpt[@]/--seq/--seq-len}" \
                   --global-batch 32 --micro-batches 8 --steps 5 --warmup 2 --runs torch-compiled pipezero-1-compile \
                   --float8 rowwise ;;
    float8-init) for f in "" "--float8 tensorwise"; do  # the DeepSpeed-shaped loop (initialize) in fp8 beside bf16
                   run "float8-init${f:+-fp8}" 300 python3 bench/hf.py --device cuda --nproc 1 --steps 3 \
                     --runs torch-compiled pipezero-initialize $f
                 done ;;
    speed-more) run speed-hf-init 420 python3 bench/hf.py --device cuda --nproc 1 --steps 3 --runs torch-compiled \
                  pipezero-initialize pipe-1f1b-compile deepspeed-1 ;;  # issue 31: the DeepSpeed-shaped loop beside
                # DeepSpeed's (carry its wheel, built with DS_BUILD_OPS=0, and its dependencies in .whl)
    grad-sums-hf) run grad-sums-hf 280 python3 bench/hf.py --device cuda --nproc 1 --steps 3 --runs torch-compiled \
                    pipezero-initialize deepspeed-1 pipe-1f1b-compile pipe-1f1b-fast  # bf16 gradients summed in bf16,
                  run grad-sums-hf-fp32 200 python3 bench/hf.py --device cuda --nproc 1 --steps 3 \
                    --grad-accum-dtype fp32 --runs pipezero-initialize deepspeed-1 ;;  # then in fp32 (ds_config
                  # data_types); carry DeepSpeed's wheel and transformers 5.24 in .whl, as for speed-more
    grad-sums-gpt) gpt_run=(python3 bench/train.py --device cuda --world 1 --layers 24 --d-model 2048 --heads 16
                            --seq-len 2048 --vocab 32000 --global-batch 32 --micro-batches 8 --steps 5 --warmup 2)
                   run grad-sums-gpt 280 "${gpt_run[@]}" --runs torch-compiled pipezero-1-compile pipezero-1-fast
                   run grad-sums-gpt-fp32 200 "${gpt_run[@]}" --grad-accum-dtype fp32 --runs pipezero-1-compile ;;
    grad-fusion) run grad-fusion 120 python3 bench/grad_fusion.py --device cuda ;;  # weight-gradient sums in the GEMM
    autotune) run autotune-default 170 python3 bench/hf.py --device cuda --nproc 1 --steps 3 --runs torch-compiled \
                pipezero-1-compile  # the Llama's layers compiled in torch's default mode, then with Triton GEMM
              run autotune-max 380 env TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS=ATEN,TRITON python3 bench/hf.py \
                --device cuda --nproc 1 --steps 3 --compile-mode max-autotune-no-cudagraphs --runs pipezero-1-compile \
                torch-compiled ;;  # templates beside cuBLAS (epilogues fused into the winners), ours first, then the peer
    speed-profile) run speed-hf-profile 240 python3 bench/hf.py --device cuda --nproc 1 --steps 3 --runs torch-compiled \
                     pipezero-1-compile pipe-1f1b-compile --profile "$out/prof"
                   run speed-gpt-profile 200 python3 bench/train.py --device cuda --world 1 "${gpt[@]/--seq/--seq-len}" \
                     --global-batch 32 --micro-batches 8 --steps 4 --warmup 2 --runs torch-compiled pipezero-1-compile \
                     pipezero-1-fast --profile "$out/prof"
                   for c in "" --compile; do
                     run tp-dispatch-profile$c 70 python3 bench/tp_dispatch.py --device cuda --d-model 2048 --heads 16 \
                       --seq 2048 --batch 1 --dtype bfloat16 --rounds 11 --repeats 20 $c --profile "$out/prof"
                   done  # issue 31: where the time goes (one step of each under torch.profiler, in profiles.txt)
                   cat "$out"/prof/*.txt > "$out/profiles.txt" && rm -r "$out/prof" ;;
    one-gpu) run one-gpu-zero 240 python3 bench/zero.py --device cuda --nproc 1 --runs pipezero-1 deepspeed-1 --steps 3 ;;
    generate-test) run generate-test 120 python3 -m pytest -q -p no:cacheprovider tests/test_generate_static.py ;;
    profile) run zero-profile 240 python3 bench/zero.py --device cuda --runs pipezero-0 pipezero-1 --steps 3 \
               --profile "$out/profile"
             run zero-fused 150 python3 bench/zero.py --device cuda --runs pipezero-1 --adam fused --steps 3 ;;
    pipe-profile) run pipe-profile 240 python3 bench/pipe.py --device cuda --world 2 "${gpt[@]}" --batch 32 \
                    --microbatches 8 --steps 3 --precision bf16 --partition measured --schedules ZeroBubbleV 1F1B \
                    --no-deepspeed --profile "$out/profile" --trace "$out/trace" ;;
    pipe-masters) run pipe-masters 420 python3 bench/pipe.py --device cuda --world 2 "${gpt[@]}" --batch 32 \
                    --microbatches 8 --steps 5 --precision bf16 --optimizer adam-masters --partition measured ;;
    pipe-gaps) run pipe-gaps 300 python3 bench/pipe.py --device cuda --world 2 "${gpt[@]}" --batch 32 --microbatches 8 \
                 --steps 5 --partition measured --schedules GPipe --no-deepspeed --profile "$out/profile" \
                 --trace "$out/trace" ;;
    trace) run pipe-trace 240 python3 bench/pipe.py --device cuda --world 2 "${gpt[@]}" --batch 32 --microbatches 8 \
             --steps 3 --precision bf16 --schedules 1F1B ZeroBubbleV --trace "$out/trace" ;;
  esac
done
