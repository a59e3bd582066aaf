import torch, sys
sys.path.insert(0, ".")
from tests.test_dispatch import _launch_cases
for name, call in _launch_cases("cuda").items():
    call(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call(); torch.cuda.synchronize()
    ks = [e.name[:60] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(name, len(ks), ks)
