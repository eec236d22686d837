"""Hardware limits of datacenter Blackwell (sm_100a: B200, GB200) that the block-scaled kernels'
validity rules and the default heuristics use. A leaf module, like :mod:`autofp4.hopper`."""
from __future__ import annotations

#: bytes of shared memory one CTA may use (opt-in maximum)
SMEM_PER_CTA = 227 * 1024
#: tensor-memory columns of one SM (128 lanes x 512 columns of 32 bits)
TMEM_COLS = 512
#: the portable thread-block-cluster size
MAX_CLUSTER = 8
#: multiprocessors of a B200 (a hint for the persistent grid where no GPU is present)
SM_COUNT = 148
