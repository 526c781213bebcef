"""The MicroPack sizes a replica's search tries, and the two ways it walks them."""
from __future__ import annotations

from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Callable

from ...config import PlannerTunables, SlimPackConfig

Fits = Callable[[int], bool]  # MicroPack tokens -> whether that size fits (or is done with)


@dataclass(frozen=True)
class SizeLadder:
    """MicroPack sizes in tokens, largest first. `try_all` tries every one and bisects where one
    that does not fit sits above one that does; `first_fit` stops at the first that fits."""

    micropack_tokens: tuple[int, ...]
    tunables: PlannerTunables = PlannerTunables()

    @classmethod
    def below_cap(cls, token_cap: int, config: SlimPackConfig) -> "SizeLadder":
        """The cap, halved three times, and three quarters of each but the last (at least
        `min_micropack_tokens`); only the slice size the user set, if any. Where memory is tight
        (a deep pipeline holding a long chain) the largest size that fits is often between two
        halvings, and a MicroPack a quarter smaller than needed costs a few percent more per token."""
        tunables = config.tunables
        if config.slice_tokens:
            return cls((min(config.slice_tokens, token_cap),), tunables)
        halvings = [token_cap]
        while halvings[-1] // 2 >= tunables.min_micropack_tokens and len(halvings) < 4:
            halvings.append(halvings[-1] // 2)
        quarters = [tokens * 3 // 4 for tokens in halvings[:-1]]
        return cls(tuple(sorted(set(halvings + quarters), reverse=True)), tunables)

    @property
    def largest(self) -> int:
        return self.micropack_tokens[0]

    @property
    def smallest(self) -> int:
        return self.micropack_tokens[-1]

    def starting_at(self, micropack_tokens: int) -> "SizeLadder":
        """`micropack_tokens` (it may lie between two rungs), then the smaller rungs."""
        smaller = tuple(tokens for tokens in self.micropack_tokens if tokens < micropack_tokens)
        return SizeLadder((micropack_tokens,) + smaller, self.tunables)

    def first_fit(self, fits: Fits) -> int | None:
        """The first size, largest first, that fits; None when none does."""
        return next((tokens for tokens in self.micropack_tokens if fits(tokens)), None)

    def try_all(self, try_size: Fits) -> None:
        """Call `try_size` on every size, largest first (the caller keeps what it finds). Where a
        size does not fit and the next one does, the sizes between are bisected to within
        1/`refine_fraction`: the rungs are a quarter to a third apart, and where memory decides
        the size, the largest that fits costs the least per token."""
        for _ in self.walk(try_size):
            pass

    def walk(self, try_size: Fits, first_fit: bool = False) -> Iterator[int]:
        """`try_all` (with `first_fit`: `first_fit`) one call at a time: yields each size right
        after `try_size` tried it, so a caller can pause the walk (a replica first only checked to
        fit) and resume it later."""
        if first_fit:
            for tokens in self.micropack_tokens:
                fits = try_size(tokens)
                yield tokens
                if fits:
                    return
            return
        too_large = None  # the last size that did not fit, until a smaller one does
        for tokens in self.micropack_tokens:
            fits = try_size(tokens)
            yield tokens
            if not fits:
                too_large = tokens
            elif too_large is not None:
                yield from self._bisection(try_size, tokens, too_large, self.tunables.refine_fraction)
                too_large = None

    def largest_fitting(self, fits: Fits, low: int, high: int, fraction: int = 0) -> int:
        """Bisect, in `size_granule` steps, for the largest size that fits between `low` (fits)
        and `high` (does not); with `fraction`, stop within low / fraction."""
        bisection = self._bisection(fits, low, high, fraction)
        while True:
            try:
                next(bisection)
            except StopIteration as done:
                return done.value

    def _bisection(self, fits: Fits, low: int, high: int, fraction: int) -> Generator[int, None, int]:
        """`largest_fitting`, yielding each size tried; returns the largest that fits."""
        granule = self.tunables.size_granule
        while high - low > max(low // fraction if fraction else 0, granule):
            middle = (low + high) // 2 // granule * granule
            if middle <= low:
                break
            if fits(middle):
                low = middle
            else:
                high = middle
            yield middle
        return low


__all__ = ["SizeLadder"]
