"""Sample text from the GPT that examples/train_gpt.py exported (pipezero/train/gpt/generate.py).

    python examples/generate.py --checkpoint runs/gpt --prompt "def " --tokens 200

Generation (KV cache, left-padded batches, a CUDA-graph decode step) lives in the package; this
script runs its command, and `import generate` (examples/ on sys.path) is that module itself.
"""

import sys

from pipezero.train.gpt import generate as _generate

if __name__ == "__main__":
    _generate.main()
else:  # the package's module under this name too: one set of functions (tests patch them)
    sys.modules[__name__] = _generate
