"""bench_model.py with the residual add + RMSNorm fusion (passes/all_reduce_norm.py) turned off: the "off" side of
the A/B in benchmarks/results/decode/rms_norm_ab/ (the "on" side is bench_model.py itself, same arguments).

    torchrun --nproc-per-node 2 benchmarks/probes/no_rms_norm_fusion.py --out $OUT/off --models llama2 --tp plain \
        --phases fwd --tokens 8,64,128 --modes flux,nocomm,inductor --rounds 4 --compile-mode reduce-overhead
"""

import os
import runpy
import sys

import fluxinductor.passes.all_reduce_norm as all_reduce_norm

all_reduce_norm.fuse_all_reduce_rms_norm = lambda graph: 0  # the pass manager looks it up on every graph
here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, here)
sys.argv = [os.path.join(here, "bench_model.py")] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
