"""Quick GPU sanity check (seconds): Triton kernels vs the CPU references on a few shapes."""

import torch

import lowp_ops
from lowp_ops.reference import cross_entropy as ce_ref
from lowp_ops.reference import mxfp8 as mxfp8_ref
from lowp_ops.reference import softmax as softmax_ref

torch.manual_seed(0)
failures = 0
for shape in [(4096, 4096), (1000, 257), (3, 70, 33)]:
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(*shape) * torch.logspace(-6, 6, shape[-1])).to(dtype)
        for fp8 in ("e4m3", "e5m2"):
            for layout in ("compact", "swizzled"):
                gpu = torch.ops.lowp.mxfp8_quantize(x.cuda(), fp8, True, True, layout)
                cpu = mxfp8_ref.mxfp8_quantize(x, fp8, True, True, layout)
                same = all(torch.equal(a.cpu(), b) for a, b in zip(gpu, cpu, strict=True))
                failures += not same
                print("mxfp8", shape, dtype, fp8, layout, "bytes equal" if same else "MISMATCH")

for n_rows, vocab in [(256, 129280), (1000, 50257), (77, 333)]:
    logits = (torch.randn(n_rows, vocab) * 3).to(torch.bfloat16)
    logits[0, :40000] = float("-inf")
    target = torch.randint(0, vocab, (n_rows,))
    target[1] = -100
    loss_g, lse_g = torch.ops.lowp.cross_entropy_fwd(logits.cuda(), target.cuda(), 0.1, -100)
    loss_c, lse_c = ce_ref.cross_entropy_fwd(logits, target, 0.1, -100)
    grad_rows = torch.rand(n_rows)
    dl_g = torch.ops.lowp.cross_entropy_bwd(
        logits.cuda(), target.cuda(), lse_c.cuda(), grad_rows.cuda(), 0.1, -100
    )
    dl_c = ce_ref.cross_entropy_bwd(logits, target, lse_c, grad_rows, 0.1, -100)

    def err(a, b):
        return (a.cpu().float() - b.float()).abs().nan_to_num(0.0, 0.0, 0.0).max().item()

    print(
        "ce",
        n_rows,
        vocab,
        "loss err",
        (loss_g.cpu() - loss_c).abs().max().item(),
        "lse err",
        (lse_g.cpu() - lse_c).abs().max().item(),
        "grad err",
        (dl_g.cpu().float() - dl_c.float()).abs().max().item(),
    )
    fused = torch.ops.lowp.cross_entropy_bwd_mxfp8(
        logits.cuda(), target.cuda(), lse_c.cuda(), grad_rows.cuda(), 0.1, -100, "e4m3", True, True, "compact"
    )
    unfused = torch.ops.lowp.mxfp8_quantize(dl_g, "e4m3", True, True, "compact")
    same = all(torch.equal(a, b) for a, b in zip(fused, unfused, strict=True))
    failures += not same
    print("ce mxfp8 contract", "bytes equal" if same else "MISMATCH")

x = torch.randn(64, 10000)
x[0] = float("-inf")
x[1, :5000] = float("-inf")
softmax_err = (lowp_ops.softmax(x.cuda()).cpu() - softmax_ref.softmax_fwd(x, False, "nan")).abs().nan_to_num().max()
print("softmax err", softmax_err.item())
print("FAILURES", failures)
