"""The benchmarks, each a command; none is imported by the library or used as a test.

    python -m cupyloss.bench                  the losses against torch eager, torch.compile and
                                              CuPy (losses.py), and the small-call host times
    python -m cupyloss.bench.accuracy         error against float64, next to torch's
    python -m cupyloss.bench.bandwidth        the copy bandwidth the tables are measured against
    python -m cupyloss.bench.broadcast        broadcast operands per family
    python -m cupyloss.bench.firstcall        the first call on a fresh machine
    python -m cupyloss.bench.rowwise          the row-reduce losses (cross entropy and its kin)
    python -m cupyloss.bench.torch_adapter    cupyloss.torch eager and compiled
    python -m cupyloss.bench.jax_adapter      cupyloss.jax against XLA and optax
    python -m cupyloss.bench.linear           the fused linear cross entropy (the LM head)
    python -m cupyloss.bench.parallel         the vocab-parallel forms over ranks
    python -m cupyloss.bench.train            the LM head in a real training loop

_timing.py holds what they share: device timing, warm-up, the one-line refusal without a GPU.
"""
