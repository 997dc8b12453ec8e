"""`python -m eagle3lib.train --config C --run-name R` / `torchrun --nproc-per-node N -m eagle3lib.train ...`: stage 05
without the notebook (eagle3lib.train.launch.main)."""

import sys

from eagle3lib.train.launch import main

if __name__ == "__main__":
    sys.exit(main())
