"""bench.train's corpus on the CPU: the standard library's sources as byte pairs, decoded back."""

import numpy as np
import pytest

from cupyloss.bench import train as bench_train

LIMIT = 1 << 20          # a MiB of sources: every file in order until the limit is passed


def _decode(ids, vocab, raw):
    """Bytes of token ids: < 256 a byte, else the pair of rank id - 256 among raw's pairs."""
    pairs = raw[0::2] * 256 + raw[1::2]
    order = np.argsort(-np.bincount(pairs, minlength=65536), kind="stable")
    out = bytearray()
    for t in ids.tolist():
        if t < 256:
            out.append(t)
        else:
            out += bytes(divmod(int(order[t - 256]), 256))
    return bytes(out)


@pytest.mark.parametrize("vocab", [300, 4096, 65536 + 256])
def test_corpus_decodes_to_the_sources(vocab):
    raw = bench_train._sources(LIMIT)
    ids = bench_train.corpus(vocab, LIMIT)
    assert ids.dtype == np.int64 and ids.min() >= 0 and ids.max() < vocab
    assert _decode(ids, vocab, raw) == raw.astype(np.uint8).tobytes()
    # a pair is one token when it ranks below vocab - 256, else two byte tokens
    assert ids.size >= raw.size // 2
    if vocab >= 65536 + 256:
        assert ids.size == raw.size // 2
