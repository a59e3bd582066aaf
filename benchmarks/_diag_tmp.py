import torch, traceback, lowp_ops
x = torch.randn(24, 300, dtype=torch.bfloat16, device="cuda", requires_grad=True); t = torch.randint(0, 300, (24,), device="cuda")
f = torch.compile(lambda x, t: lowp_ops.cross_entropy(x, t), fullgraph=True)
try:
    f(x, t).backward()
except Exception as e:
    c = e
    while c is not None:
        print("=== CHAIN", type(c).__name__, str(c)[-1500:])
        c = c.__cause__ or c.__context__
    s = str(e)
    i = s.find("CompilationError")
    print(s[:200]); print("....."); print(s[max(0, i-200):i+2500])
    import re
    for m in re.finditer(r"(NameError|not defined|AttributeError|Cannot|unsupported|error:)[^\n]*", s): print("MATCH", m.group(0)[:300])
