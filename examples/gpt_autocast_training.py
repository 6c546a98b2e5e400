"""Train a small GPT the way most language models are trained, its head's loss from cupyloss.

    python examples/gpt_autocast_training.py [--width 512] [--vocab 65536] [--steps 100]

bfloat16 autocast over float32 master weights, AdamW, the blocks under torch.compile, and the
output layer's loss as cupyloss.torch.linear_cross_entropy(hidden, lm_head.weight, labels):
inside autocast its products run in bfloat16 as lm_head's would, the logits are never whole, and
the float32 weight's gradient is formed in float32.  The corpus is the Python standard
library's sources as byte pairs (cupyloss.bench.train.corpus).  Checks that the first step's
loss is torch's ``F.cross_entropy(lm_head(hidden).float(), labels)`` within bfloat16 rounding
and that the loss falls; prints tokens/s and the peak memory.  Needs a CUDA GPU.
"""

import argparse
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    args.steps = max(args.steps, 20)        # tokens/s is taken after the first 10
    import torch

    if not torch.cuda.is_available():
        print("this example needs a CUDA GPU")
        return 0
    import cupyloss.torch as CF
    from cupyloss.bench.train import corpus, model

    seq, batch = 1024, 8
    data = torch.from_numpy(corpus(args.vocab)).cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    starts = torch.randint(0, data.numel() - seq - 1, (args.steps, batch), device="cuda",
                           generator=gen)
    window = torch.arange(seq + 1, device="cuda")
    torch.manual_seed(0)
    body, lm_head = model(torch, args.vocab, args.width)
    body.trunk.compile(fullgraph=True)
    opt = torch.optim.AdamW([*body.parameters(), lm_head.weight], lr=1e-3, fused=True)

    losses = []
    for step in range(args.steps):
        if step == 10:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        tokens = data[starts[step][:, None] + window]
        x, y = tokens[:, :-1], tokens[:, 1:]
        with torch.autocast("cuda", torch.bfloat16):
            hidden = body(x)                                  # (8, 1024, width) float32
            loss = CF.linear_cross_entropy(hidden, lm_head.weight, y)
            if step == 0:
                with torch.no_grad():
                    want = torch.nn.functional.cross_entropy(
                        lm_head(hidden).float().flatten(0, 1), y.flatten())
                if abs(float(loss) - float(want)) > 2 ** -8 * float(want):
                    print(f"first loss {float(loss):.6f}, torch's {float(want):.6f}")
                    return 1
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    torch.cuda.synchronize()
    rate = batch * seq * (args.steps - 10) / (time.perf_counter() - t0)
    first, last = float(losses[0]), float(torch.stack(losses[-10:]).mean())
    print(f"{torch.cuda.get_device_name()}: width {args.width}, vocabulary {args.vocab}: loss "
          f"{first:.3f} -> {last:.3f}, {rate / 1e3:.0f}k tokens/s, peak "
          f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    return 0 if last < first - 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
