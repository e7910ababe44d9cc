"""Does a backward differentiate the forward that ran? A check for compiled graphs with dropout.

A compiled graph may regenerate a dropout mask in its backward instead of keeping it (Inductor does under activation
checkpointing: it keeps the mask's seed). If the regenerated mask is not the forward's, the gradients belong to
another network, and training goes on without an error. pytorch/pytorch#198333 reports such a case on CUDA since
PyTorch 2.13: Inductor draws a kernel's random numbers by one of two formulas, picked by the kernel's shape, so a
forward kernel and the backward kernel that regenerates its mask need not draw alike.

The check needs no second graph to compare with. It takes the gradient along one random direction v of the weights,
g . v, from one forward and backward, and compares it with the central difference (L(w + eps v) - L(w - eps v)) /
2 eps of the same graph's loss, each forward reseeded, so it draws the masks of the first. With the masks matched,
the two agree to rounding; a backward with other masks gives the gradient of another network. The control computes
the difference with masks drawn from another seed: what a backward with wrong masks would be measured against,
which shows that the check can fail at the shapes given.
"""

import torch


def directional_derivatives(loss_of, weights, eps, seed=1, other_seed=2):
    """(g . v from the backward, the central difference with the forward's masks, the same with other masks).

    `loss_of()` runs the forward and returns a scalar, drawing its dropout from PyTorch's global random state; every
    weight in `weights` must take part. v is a random unit vector over all the weights, the same on every call."""
    torch.manual_seed(seed)
    for weight in weights:
        weight.grad = None
    loss_of().backward()
    generator = torch.Generator().manual_seed(0)
    direction = [torch.randn(weight.shape, generator=generator).to(weight.device) for weight in weights]
    norm = torch.sqrt(sum((part.double() ** 2).sum() for part in direction))
    direction = [part / norm.to(part.dtype) for part in direction]
    along = sum((weight.grad.double() * part).sum() for weight, part in zip(weights, direction)).item()

    def central_difference(draw_from):
        values = []
        for sign in (1.0, -1.0):
            with torch.no_grad():
                for weight, part in zip(weights, direction):
                    weight.add_(part, alpha=sign * eps)
            torch.manual_seed(draw_from)
            values.append(loss_of().item())  # with gradients on: the training graph, not an inference one
            with torch.no_grad():
                for weight, part in zip(weights, direction):
                    weight.sub_(part, alpha=sign * eps)
        return (values[0] - values[1]) / (2 * eps)

    return along, central_difference(seed), central_difference(other_seed)


def relative_errors(loss_of, weights, eps, seed=1, other_seed=2):
    """(error, control): how far the backward's g . v is from the central difference with the forward's masks, and
    from the one with other masks, relative to g . v."""
    along, same_masks, other_masks = directional_derivatives(loss_of, weights, eps, seed, other_seed)
    return abs(along - same_masks) / abs(along), abs(along - other_masks) / abs(along)
