#!/usr/bin/env bash
# The front door: set up the project's own virtual environment (once), then train or test.
#
#   ./dev.sh train [train_gpt.py flags]   # the main job: every GPU here, else 4 CPU processes
#   ./dev.sh test  [pytest args]          # the test suite (what CI runs)
#
# Idempotent: .venv is made once and reinstalled only when pyproject.toml changes or a
# different torch is asked for. The torch build follows the machine: CUDA wheels when an
# NVIDIA driver answers, CPU otherwise. Override with PIPEZERO_TORCH (a pip requirement,
# e.g. "torch==2.13.0") and PIPEZERO_TORCH_INDEX (a pip index URL, e.g.
# https://download.pytorch.org/whl/cu128); PYTHON picks the interpreter (3.10 or newer).
set -euo pipefail
cd "$(dirname "$0")"

usage() { sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 1 ] || usage
command=$1; shift
case $command in train|test) ;; *) usage ;; esac

python=${PYTHON:-python3}
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null || {
  echo "dev.sh: needs Python 3.10 or newer as '$python' (set PYTHON=/path/to/python3.x)" >&2; exit 1; }

gpus=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L | grep -c '^GPU')
fi
# CPU: the build CI pins; GPU: the CUDA build pip resolves for this platform
if [ "$gpus" -gt 0 ]; then default_torch="torch>=2.11"; else default_torch="torch==2.13.0"; fi
torch_req=${PIPEZERO_TORCH:-$default_torch}
# -- the virtual environment, made or reused --------------------------------------------------------
# a stamp per (pyproject.toml, torch requirement); "-test" when the test extras are in too
venv=.venv
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
base="$venv/.pipezero-$({ cat pyproject.toml; echo "$torch_req"; } | cksum | cut -d' ' -f1)"
if [ "$command" = test ]; then want="$base-test" extras="[test]"; else want="$base" extras=""; fi
if [ ! -f "$want" ] && [ ! -f "$base-test" ]; then
  echo "dev.sh: installing $torch_req and pipezero$extras into $venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q ${PIPEZERO_TORCH_INDEX:+--index-url "$PIPEZERO_TORCH_INDEX"} "$torch_req"
  DS_BUILD_OPS=0 "$venv/bin/python" -m pip install -q -e ".$extras"   # DeepSpeed (a test-only peer): no C++ ops
  find "$venv" -maxdepth 1 -name '.pipezero-*' ! -name "$(basename "$base")*" -delete
  touch "$want"
fi
export PATH="$PWD/$venv/bin:$PATH"

# -- the command --------------------------------------------------------------------------------------
if [ "$command" = test ]; then
  exec python -m pytest -q "$@"
fi
if [ "$gpus" -gt 0 ]; then
  nproc=$gpus
  layout=$([ $((gpus % 2)) -eq 0 ] && echo "--pipe 2" || echo "--pipe 1")  # 1 GPU: data parallel of one
else
  nproc=4; layout=""
fi
out=runs/gpt prev=""
for arg in "$@"; do [ "$prev" = --out ] && out=$arg; case $arg in --out=*) out=${arg#--out=} ;; esac; prev=$arg; done
echo "dev.sh: torchrun --standalone --nproc-per-node $nproc examples/train_gpt.py $layout $*"
torchrun --standalone --nproc-per-node "$nproc" examples/train_gpt.py $layout "$@"
cat <<EOF

dev.sh: done. In $out/:
  TensorBoard logs     $out/tensorboard   (view: $venv/bin/tensorboard --logdir $out)
  checkpoints          $out/checkpoints   (the same command again resumes from the latest)
  the trained model    $out/model.safetensors   (sample: $venv/bin/python examples/generate.py --checkpoint $out)
EOF
