"""The wrapper lines that run no kernel do not stop a matmul's epilogue from
fusing, whatever the torch release calls them (2.14 added a grouped size/stride
assert line; tests/compiler/test_compile.py's rope test fails on 2.14 without it)."""

from torch_spyre.compiler.scheduling import _is_kernel_line


class GroupedAssertSizeStrideLine:  # torch 2.14's name, defined here for 2.13
    pass


class AssertSizeStrideLine:
    pass


class KernelCallLine:
    pass


def test_asserts_are_quiet_in_any_release():
    assert not _is_kernel_line(GroupedAssertSizeStrideLine())
    assert not _is_kernel_line(AssertSizeStrideLine())
    assert not _is_kernel_line("assert_size_stride_grouped([(buf0, (4, 4), (4, 1))])")
    assert not _is_kernel_line("assert_size_stride(buf0, (4, 4), (4, 1))")


def test_kernels_are_not_quiet():
    assert _is_kernel_line(KernelCallLine())
    assert _is_kernel_line("spyre_kernel_0(buf0, buf1)")
