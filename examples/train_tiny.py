"""Train a 1.1M-parameter hybrid KDA model on the byte-level text shipped with kdax, then sample.

    python examples/train_tiny.py --steps 300 --checkpoint-every 100

Same as ``kdax train``. The loop (AdamW, clipping, jit step, progress bar, checkpoints)
is kdax/train.py; the model is kdax.models.tiny_config(). ``--resume`` continues an
interrupted run from its newest checkpoint (checkpoints/tiny/state); load the final weights
with ``kdax.models.from_pretrained("checkpoints/tiny/model")``.
"""

import sys

from kdax.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
