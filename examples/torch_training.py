"""Train small models with cupyloss.torch losses next to the same models with torch's, same seed.

    python examples/torch_training.py

Three runs of 300 steps each (Adam), each twice from identical weights and batches: a regression
MLP with cupyloss.torch.mse_loss against torch.nn.functional.mse_loss, a classifier with
cupyloss.torch.KLDivLoss(reduction="batchmean") against torch.nn.KLDivLoss, and a margin
classifier with cupyloss.torch.HingeLoss against clamp(1 - s y, min=0).mean() (torch has no hinge
loss).  Then the regression step again with the loss inside torch.compile(fullgraph=True), and
captured in a CUDA graph.  Prints each pair's final losses (they may drift apart by rounding over
the steps: checked to 1e-3) and the largest gradient difference seen at any step between the two
losses on the same model (checked to 1e-5 of the largest gradient), and exits non-zero if a check
fails.
"""

import copy
import sys

from _gpu import torch_on_gpu


def _model(torch, d_in, d_out):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(d_in, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, d_out)).cuda()


def _train_pair(torch, ours, theirs, batches, head, steps=300):
    """Train one model with each loss from the same weights on the same batches.

    Returns both final losses and the largest difference, relative to the largest gradient
    element, between the gradients the two losses give the cupyloss-trained model at each step
    (both evaluated on that model, so the comparison does not include the drift between runs).
    """
    models = [_model(torch, batches[0][0].shape[1], batches[0][1].shape[1])]
    models.append(copy.deepcopy(models[0]))
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in models]
    worst = 0.0
    for step in range(steps):
        x, y = batches[step % len(batches)]
        losses = []
        for model, opt, loss_fn in zip(models, opts, (ours, theirs)):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(head(model(x)), y)
            loss.backward()
            losses.append(loss)
        params = list(models[0].parameters())
        check = torch.autograd.grad(theirs(head(models[0](x)), y), params)
        for p, q in zip(params, check):
            worst = max(worst, float((p.grad - q).abs().max() / q.abs().max().clamp_min(1e-30)))
        for opt in opts:
            opt.step()
    return [float(v) for v in losses], worst


def main() -> int:
    torch, CF = torch_on_gpu()
    F = torch.nn.functional
    g = torch.Generator(device="cuda").manual_seed(0)
    ok = True

    def report(what, losses, worst, tol=1e-5, drift=1e-3):
        nonlocal ok
        good = worst <= tol and abs(losses[0] - losses[1]) <= drift * max(abs(losses[1]), 1e-6)
        ok &= good
        print(f"{what:44s} final loss {losses[0]:.6f} (cupyloss) {losses[1]:.6f} (torch); "
              f"max grad diff {worst:.1e} {'ok' if good else 'MISMATCH'}")

    w = torch.randn(64, 10, device="cuda", generator=g)
    reg = [(x, torch.tanh(x @ w)) for x in
           (torch.randn(512, 64, device="cuda", generator=g) for _ in range(8))]
    losses, worst = _train_pair(torch, CF.mse_loss, F.mse_loss, reg, lambda out: out)
    report("regression: mse_loss", losses, worst)

    cls = []
    for _ in range(8):
        x = torch.randn(512, 64, device="cuda", generator=g)
        cls.append((x, torch.softmax(x @ w * 2.0, dim=-1)))
    losses, worst = _train_pair(torch, CF.KLDivLoss(reduction="batchmean"),
                                torch.nn.KLDivLoss(reduction="batchmean"), cls,
                                lambda out: out.log_softmax(-1))
    report("classifier: KLDivLoss(batchmean)", losses, worst)

    margin = [(x, torch.sign(x @ w)) for x, _ in reg]
    losses, worst = _train_pair(torch, CF.HingeLoss(),
                                lambda s, y: torch.clamp(1 - s * y, min=0).mean(), margin,
                                lambda out: out)
    report("margin classifier: HingeLoss", losses, worst)

    # The regression step with the loss inside one compiled graph, and captured in a CUDA graph.
    model = _model(torch, 64, 10)
    compiled = torch.compile(lambda x, y: CF.mse_loss(model(x), y), fullgraph=True)
    x, y = reg[0]
    eager_loss = CF.mse_loss(model(x), y)
    eager_grads = torch.autograd.grad(eager_loss, list(model.parameters()))
    loss = compiled(x, y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(grads, eager_grads))
    report("torch.compile(fullgraph=True): mse_loss", [float(loss), float(eager_loss)], worst)

    # A fresh model: autograd nodes kept alive from the eager steps above (by `loss`, say) would
    # accumulate its gradients on the default stream, which a capture cannot depend on.
    del loss, eager_loss, grads, eager_grads
    model = _model(torch, 64, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.01)

    def step(m, o, a, b):
        o.zero_grad(set_to_none=True)
        loss = CF.mse_loss(m(a), b)
        loss.backward()
        o.step()
        return loss

    static_x, static_y = x.clone(), y.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):          # warm-up: kernels load, allocations settle
        for _ in range(3):
            step(model, opt, static_x, static_y)
            step(reference, ref_opt, static_x, static_y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(model, opt, static_x, static_y)
    for k in range(20):
        bx, by = reg[k % len(reg)]
        static_x.copy_(bx)
        static_y.copy_(by)
        graph.replay()
        eager = step(reference, ref_opt, bx, by)
    worst = max(float((p - q).abs().max() / q.abs().max())
                for p, q in zip(model.parameters(), reference.parameters()))
    report("CUDA graph replay vs eager: parameters", [float(static_loss), float(eager)], worst)
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
