"""BatchNorm with statistics over the global batch, on Horovod's allreduce (CPU and GPU).

Horovod's own ``horovod.torch.SyncBatchNorm`` accepts GPU tensors only and relies on CUDA-only
kernels, so this one is written with plain torch ops around ``hvd.allreduce``, which is
differentiable (its backward is an allreduce-sum of the incoming gradients). That sum is what
makes the result exact: each rank's input gradient then carries every rank's loss through the
shared statistics, and averaging parameter gradients over ranks gives the gradient of the
global-batch loss, as one process with the whole batch would compute it.
"""

from __future__ import annotations


def sync_batchnorm_class(torch, hvd):
    """The ``SyncBatchNorm`` module class for this torch and Horovod (built lazily)."""
    f = torch.nn.functional

    class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
        """``BatchNorm{1,2,3}d`` whose training statistics span every rank's samples."""

        def _check_input_dim(self, input):
            if input.dim() < 2:
                raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

        def forward(self, input):
            self._check_input_dim(input)
            if not self.training and self.track_running_stats:
                return f.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                    self.bias, False, 0.0, self.eps)
            if hvd.size() == 1:  # exactly torch's BatchNorm
                if self.training and self.track_running_stats:
                    self.num_batches_tracked.add_(1)
                momentum = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                            else self.momentum)
                return f.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                    self.bias, True, momentum, self.eps)
            dims = [0, *range(2, input.dim())]
            count = torch.tensor([float(input.numel() // input.shape[1])], dtype=input.dtype,
                                 device=input.device)
            total = hvd.allreduce(count, op=hvd.Sum, name=None)
            mean = hvd.allreduce(input.sum(dims), op=hvd.Sum) / total
            shape = [1, -1] + [1] * (input.dim() - 2)
            centred = input - mean.reshape(shape)
            var = hvd.allreduce((centred * centred).sum(dims), op=hvd.Sum) / total
            if self.training and self.track_running_stats:
                self.num_batches_tracked.add_(1)
                m = 1.0 / float(self.num_batches_tracked) if self.momentum is None \
                    else self.momentum
                with torch.no_grad():
                    n = float(total)
                    self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                    unbiased = var.detach() * (n / max(n - 1.0, 1.0))
                    self.running_var.mul_(1 - m).add_(unbiased, alpha=m)
            out = centred * torch.rsqrt(var + self.eps).reshape(shape)
            if self.affine:
                out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
            return out

    return SyncBatchNorm


def convert_sync_batchnorm(torch, hvd, module) -> int:
    """Replaces every BatchNorm layer in ``module`` by :func:`sync_batchnorm_class`'s, in place.

    The affine parameters stay the same Parameter objects (an optimizer already built over the
    model keeps working) and the running statistics the same buffers. Returns how many layers
    were converted.
    """
    cls = sync_batchnorm_class(torch, hvd)
    base = torch.nn.modules.batchnorm._BatchNorm
    converted = 0
    for name, child in module.named_children():
        if isinstance(child, base) and type(child).__name__ != "SyncBatchNorm":
            sync = cls(child.num_features, eps=child.eps, momentum=child.momentum,
                       affine=child.affine, track_running_stats=child.track_running_stats)
            sync = sync.to(next(iter(child.buffers()), torch.empty(0)).dtype)
            if child.affine:
                sync.weight, sync.bias = child.weight, child.bias
            if child.track_running_stats:
                sync.running_mean, sync.running_var = child.running_mean, child.running_var
                sync.num_batches_tracked = child.num_batches_tracked
            sync.train(child.training)
            setattr(module, name, sync)
            converted += 1
        else:
            converted += convert_sync_batchnorm(torch, hvd, child)
    return converted
