"""GPTQ (Frantar et al., 2022): weight-only rounding that uses calibration activations.

Round-to-nearest rounds each weight on its own. GPTQ rounds the input columns of a
linear one at a time and moves each column's rounding error onto the columns not yet
rounded, weighted by the inverse Hessian H = X^T X of the layer's calibration inputs,
so that the layer's output on those inputs, X W^T, changes as little as it can. The
scale and zero point of a group are taken from the group's weights as they stand when
its first column comes up (after the error of earlier groups has landed on them), as
AutoGPTQ and llmcompressor do.

Decoder layers are done in order and each layer's Hessians are collected with the layers
before it already quantized, so a layer also makes up for the error it receives.
Columns stay in their order (no act-order), which keeps the groups contiguous: the
result is the ordinary compressed-tensors `pack-quantized` group layout.

The rounding itself (scale and zero point of a group, quantize-dequantize) is
compressed-tensors', passed in as two functions, so GPTQ and round-to-nearest write
the same grid.
"""

from __future__ import annotations

from typing import Callable

import torch

# (weights of one group [out, g]) -> (scale [out], zero point [out])
QParams = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# (column [out], scale [out], zero point [out]) -> the column quantized and dequantized
FakeQuantize = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@torch.no_grad()
def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, qparams: QParams, fake_quantize: FakeQuantize,
                  group_size: int, block_size: int = 128, damp: float = 0.01
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dequantized weight, scales [out, groups], zero points [out, groups]).
    group_size -1: one scale per output channel, from the whole row."""
    w = weight.detach().clone().float()
    out_features, cols = w.shape
    h = hessian.detach().clone().double()
    dead = torch.diag(h) == 0                     # inputs never seen: no error to weigh
    h[dead, dead] = 1
    w[:, dead] = 0
    # Dampening keeps the Cholesky factorisation defined for a rank-deficient H.
    h += damp * torch.diag(h).mean() * torch.eye(cols, dtype=h.dtype, device=h.device)
    h_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()

    g = cols if group_size == -1 else group_size
    scales: list[torch.Tensor] = []
    zeros: list[torch.Tensor] = []
    q = torch.zeros_like(w)
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        w1, err1, h1 = w[:, i1:i2].clone(), torch.zeros(out_features, i2 - i1, device=w.device), h_inv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % g == 0:
                # The group's current weights: this block's updated columns, then later ones.
                group = torch.cat([w1[:, i:], w[:, i2:]], dim=1)[:, :g]
                scale, zero = qparams(group)
                scales.append(scale)
                zeros.append(zero)
            qc = fake_quantize(w1[:, i], scales[-1], zeros[-1])
            q[:, col] = qc
            e = (w1[:, i] - qc) / h1[i, i]
            w1[:, i:] -= e[:, None] * h1[i, i:][None, :]
            err1[:, i] = e
        w[:, i2:] -= err1 @ h_inv[i1:i2, i2:]
    return q, torch.stack(scales, dim=1), torch.stack(zeros, dim=1)


@torch.no_grad()
def layer_inputs(model, batches: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[list[dict]]]:
    """From one pass of the source model, per calibration text: the first decoder layer's
    hidden states, and the keyword arguments each layer is called with. The masks and
    position embeddings in those do not depend on the weights, and each layer keeps its
    own (sliding-window layers get other masks). Later layers' hidden states are not
    kept: they come from the quantized layers before them."""
    layers = list(model.model.layers)
    hidden: list[torch.Tensor] = []
    kwargs: list[list[dict]] = [[] for _ in layers]

    def record(mod, args, kw, i):
        if i == 0:
            hidden.append(args[0])
        kwargs[i].append(kw)
    hooks = [layer.register_forward_pre_hook(lambda mod, args, kw, i=i: record(mod, args, kw, i), with_kwargs=True)
             for i, layer in enumerate(layers)]
    try:
        for ids in batches:
            model.model(ids[None], use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return hidden, kwargs


def _run_layer(layer, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def gptq_model(model, linears: dict[str, torch.nn.Linear], batches: list[torch.Tensor], qparams: QParams,
               fake_quantize: FakeQuantize, group_size: int, advance: Callable[[], None]
               ) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Quantizes the decoder layers in order. Each layer runs twice on the calibration
    hidden states: with its source weights, to collect H = sum of x x^T at each linear's
    input (its scale does not matter to GPTQ), then with its quantized weights, to make
    the next layer's inputs. Returns name -> (dequantized weight, scales, zero points);
    the model is left holding the source weights."""
    hidden, layer_kwargs = layer_inputs(model, batches)
    prefix = getattr(model, "layers_prefix", "model.layers")     # (a vision-language model's decoder: its own)
    source = {n: m.weight.data.clone() for n, m in linears.items()}
    out: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    try:
        for i, layer in enumerate(model.model.layers):
            names = [n for n in linears if n.startswith(f"{prefix}.{i}.")]
            hess = {n: torch.zeros(linears[n].in_features, linears[n].in_features, dtype=torch.float64)
                    for n in names}

            def collect(mod, args, n):
                x = args[0].reshape(-1, args[0].shape[-1]).float()
                hess[n] += (x.T @ x).double()
            hooks = [linears[n].register_forward_pre_hook(lambda mod, args, n=n: collect(mod, args, n))
                     for n in names]
            try:
                for h, kwargs in zip(hidden, layer_kwargs[i]):
                    _run_layer(layer, h, kwargs)
            finally:
                for hook in hooks:
                    hook.remove()
            for n in names:
                out[n] = gptq_quantize(linears[n].weight.data, hess[n], qparams, fake_quantize, group_size)
                linears[n].weight.data = out[n][0].to(linears[n].weight.dtype)
                advance()
            hidden = [_run_layer(layer, h, kwargs) for h, kwargs in zip(hidden, layer_kwargs[i])]
    finally:
        for n, m in linears.items():
            m.weight.data = source[n]
    missing = set(linears) - set(out)
    if missing:
        raise RuntimeError(f"GPTQ found no decoder layer for {sorted(missing)}")
    return out
