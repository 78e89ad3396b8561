"""Rewrites of the traced modules before scripting: each computes the same function with fewer
kernels or without a host synchronisation, and the export's gates check the result like any other
step (sharded vs float on the sample batch).

- ``drop_whole_kjt_splits`` (lookup): TorchRec's one-device input distribution "splits" the KJT
  into one piece holding every feature, and ``KeyedJaggedTensor.split`` computes the per-key lengths
  on the host first: a device synchronisation on every call, which also makes the forward impossible
  to capture in a CUDA graph. One piece of every feature is the KJT itself.
- ``fold_bias_into_linear`` (head): ``linear(x, W) + b`` -> ``linear(x, W, b)``: cuBLAS adds the
  bias in the matmul's epilogue instead of a kernel that reads and writes the whole activation.
- ``use_addcmul`` (head): ``a * b + c`` -> ``addcmul(c, a, b)``: one elementwise kernel instead of
  two (DCN's cross layer ``x0 * (xW + b) + x`` is this, on [B, 3456] activations).
"""
import operator
from typing import Any, Optional

import torch
import torch.fx
from torch.fx.passes.shape_prop import ShapeProp


def drop_whole_kjt_splits(traced: torch.fx.GraphModule, feature_count: int) -> int:
    """Remove ``kjt.split([feature_count])``; returns how many were removed. Real splits (several
    devices, several TBEs) are left as they are."""
    graph, removed = traced.graph, 0
    for node in list(graph.nodes):
        if not (node.op == "call_method" and node.target == "split" and len(node.args) == 2 and not node.kwargs
                and list(node.args[1]) == [feature_count]):
            continue
        users = list(node.users)
        if not all(u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0 for u in users):
            continue
        for user in users:
            user.replace_all_uses_with(node.args[0])
            graph.erase_node(user)
        graph.erase_node(node)
        removed += 1
    _done(traced)
    return removed


def _tensor_meta(node: Any) -> Optional[Any]:
    return node.meta.get("tensor_meta") if isinstance(node, torch.fx.Node) else None


def _is_add(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in (operator.add, torch.add) and len(node.args) == 2 \
        and not node.kwargs


def fold_bias_into_linear(traced: torch.fx.GraphModule, *sample: torch.Tensor) -> int:
    """Returns how many additions were folded. Needs shapes: runs ``sample`` through the module."""
    ShapeProp(traced).propagate(*sample)
    graph, folded = traced.graph, 0
    for add in list(graph.nodes):
        if not _is_add(add):
            continue
        for lin, bias in (add.args, add.args[::-1]):
            if not (isinstance(lin, torch.fx.Node) and lin.op == "call_function"
                    and lin.target in (torch.nn.functional.linear, torch._C._nn.linear)
                    and len(lin.args) == 2 and not lin.kwargs and len(lin.users) == 1):
                continue
            b, out = _tensor_meta(bias), _tensor_meta(lin)
            if bias.op != "get_attr" or b is None or out is None or tuple(b.shape) != (out.shape[-1],) \
                    or b.dtype != out.dtype:
                continue
            lin.prepend(bias)  # a parameter read depends on nothing: it may move up
            lin.args = (lin.args[0], lin.args[1], bias)
            add.replace_all_uses_with(lin)
            graph.erase_node(add)
            folded += 1
            break
    _done(traced)
    return folded


def use_addcmul(traced: torch.fx.GraphModule, *sample: torch.Tensor) -> int:
    """Returns how many ``a * b + c`` became ``addcmul``. Only where a, b and c are all tensors of
    one dtype and the product's shape is the sum's (so broadcasting is unchanged)."""
    ShapeProp(traced).propagate(*sample)
    graph, rewritten = traced.graph, 0
    for add in list(graph.nodes):
        if not _is_add(add):
            continue
        for mul, other in (add.args, add.args[::-1]):
            if not (isinstance(mul, torch.fx.Node) and mul.op == "call_function"
                    and mul.target in (operator.mul, torch.mul) and len(mul.args) == 2 and not mul.kwargs
                    and len(mul.users) == 1):
                continue
            metas = [_tensor_meta(n) for n in (*mul.args, other, mul, add)]
            if any(m is None for m in metas) or len({m.dtype for m in metas}) != 1 \
                    or tuple(metas[3].shape) != tuple(metas[4].shape):
                continue
            with graph.inserting_before(add):
                fused = graph.call_function(torch.addcmul, (other, mul.args[0], mul.args[1]))
            fused.meta = dict(add.meta)
            add.replace_all_uses_with(fused)
            graph.erase_node(add)
            graph.erase_node(mul)
            rewritten += 1
            break
    _done(traced)
    return rewritten


def _done(traced: torch.fx.GraphModule) -> None:
    traced.graph.lint()
    traced.recompile()
