"""Profile what runs on spyre: kernels and transfers, in modelled time.

    import torch_spyre.profiler as sprof
    with sprof.profile() as prof:
        ...  # anything that runs kernels or copies on spyre
    print(prof.table())
    prof.export_chrome_trace("trace.json")   # Perfetto / chrome://tracing
    prof.roofline_plot("roofline.png")       # needs matplotlib

Depends only on ``torch_spyre.sim`` (its trace sink), not on the runtime.
"""

from torch_spyre.profiler.profile import KernelEntry, Profile, profile

__all__ = ["KernelEntry", "Profile", "profile"]
