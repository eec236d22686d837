"""Hardware limits of Hopper (sm_90) that the kernels' validity rules and the default heuristics
use. A leaf module: named once here, imported by the kernels and the backend."""
from __future__ import annotations

#: bytes of shared memory one CTA may use (opt-in maximum)
SMEM_PER_CTA = 227 * 1024
#: shared memory of one SM, shared by its resident CTAs
SMEM_PER_SM = 228 * 1024
#: the driver's shared-memory reservation per resident CTA
SMEM_PER_CTA_RESERVED = 1024
#: 32-bit registers of one SM
REGS_PER_SM = 65536
#: resident threads of one SM
THREADS_PER_SM = 2048
#: the portable thread-block-cluster size
MAX_CLUSTER = 8
#: multiprocessors of an H100 / H200 SXM (a hint for defaults where no GPU is present)
SM_COUNT = 132
