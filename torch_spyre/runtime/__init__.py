"""PyTorch device semantics for spyre: registration, memory, layout access, copies."""
