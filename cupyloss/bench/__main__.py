"""python -m cupyloss.bench: the losses' benchmark (cupyloss/bench/losses.py)."""

from cupyloss.bench.losses import main

main()
