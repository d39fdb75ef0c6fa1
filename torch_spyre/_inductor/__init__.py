"""IBM's ``torch_spyre._inductor`` module path, for IBM's clients (docs/compat.md).

``config``, ``constants`` and ``decompositions`` are thin facades defined in
``torch_spyre.compat``; our compiler is ``torch_spyre.compiler``.
"""
