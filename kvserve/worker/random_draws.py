"""Normal draws for random-weight models (weights.random_weights): one seeded generator on a draw device for the
whole model, so that one seed gives the same weights whichever family's builder draws them and wherever they go."""

from __future__ import annotations

import torch


class Draws:
    """Draws of ``gen`` on ``draw`` (normal in float32, times ``std``), moved to ``device`` in ``dtype`` (or the
    dtype a call asks for, e.g. a float32 router)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, seed: int, std: float, draw: torch.device):
        self.device, self.dtype, self.std, self.draw = device, dtype, std, draw
        self.gen = torch.Generator(device=draw).manual_seed(seed)

    def mat(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        x = torch.randn(*shape, generator=self.gen, device=self.draw, dtype=torch.float32) * self.std
        return x.to(self.device, dtype or self.dtype)

    def ones(self, size: int) -> torch.Tensor:
        return torch.ones(size, device=self.device, dtype=self.dtype)

    def gated_mlp(self, hidden: int, intermediate: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A gated MLP's fused gate/up [2 * intermediate, hidden] and down [hidden, intermediate]."""
        return self.mat(2 * intermediate, hidden), self.mat(hidden, intermediate)
