"""Communication graphs for decentralized training, with doubly stochastic mixing matrices.

A :class:`Topology` over ``n`` ranks holds a mixing matrix ``W`` (``n x n``): row ``i`` is what rank ``i`` gives to its
in-neighbours and itself, so one gossip round is ``x_i <- sum_j W[i, j] x_j``. ``W`` is doubly stochastic (rows and
columns sum to one), so the average of any vector over the ranks is preserved by gossip, and the graph of its nonzero
entries is strongly connected, so repeated gossip reaches consensus. Undirected graphs get Metropolis-Hastings weights
``W[i, j] = 1 / (1 + max(d_i, d_j))`` (symmetric, doubly stochastic for any graph).

Graphs: :meth:`Topology.ring`, :meth:`Topology.torus`, :meth:`Topology.exponential` (static exponential graph, each
rank sends to ``i + 2^k``), :meth:`Topology.fully_connected`, :meth:`Topology.from_graph` (any connected networkx
graph), and :class:`MatchaTopology`: time-varying graphs in the style of MATCHA (Wang et al., 2019), where the base
graph is cut into matchings and each step activates every matching with probability ``budget`` (the expected share
of the base graph's communication), the same on every rank (seeded by the step).
"""

from __future__ import annotations

import math
import random

import networkx as nx
import torch

from hf_dtrain.errors import SettingsError

_TOL = 1e-9


def metropolis_weights(graph: nx.Graph, n: int) -> torch.Tensor:
    """Metropolis-Hastings mixing matrix of an undirected graph on nodes ``0..n-1`` (isolated nodes keep 1)."""
    w = torch.zeros(n, n, dtype=torch.float64)
    degree = dict(graph.degree())
    for i, j in graph.edges():
        if i == j:
            continue
        w[i, j] = w[j, i] = 1.0 / (1 + max(degree[i], degree[j]))
    w += torch.diag(1.0 - w.sum(1))
    return w


class Topology:
    """A static communication graph over ``n`` ranks and its doubly stochastic mixing matrix ``weights``."""

    def __init__(self, weights: torch.Tensor, name: str = "custom"):
        weights = torch.as_tensor(weights, dtype=torch.float64)
        if weights.dim() != 2 or weights.shape[0] != weights.shape[1]:
            raise SettingsError(f"Topology weights must be a square n x n matrix, got shape {tuple(weights.shape)}.")
        n = weights.shape[0]
        if n < 2:
            raise SettingsError(
                "Decentralized training needs at least 2 ranks (a world of one process has nobody to "
                "gossip with); launch with torchrun / accelerate launch --num_processes >= 2."
            )
        _check_doubly_stochastic(weights, name)
        _check_connected(weights, name)
        self.weights, self.n, self.name = weights, n, name

    # -- the graph at a step (static here; time-varying subclasses override) ----------------------------------------
    def mixing(self, step: int = 0) -> torch.Tensor:
        """``W`` used at optimizer step ``step``."""
        return self.weights

    def in_neighbors(self, rank: int, step: int = 0) -> list[int]:
        """Ranks whose values rank ``rank`` receives (``W[rank, j] > 0``, itself excluded)."""
        w = self.mixing(step)
        return [j for j in range(self.n) if j != rank and w[rank, j] > 0]

    def out_neighbors(self, rank: int, step: int = 0) -> list[int]:
        """Ranks that receive rank ``rank``'s value (``W[j, rank] > 0``, itself excluded)."""
        w = self.mixing(step)
        return [j for j in range(self.n) if j != rank and w[j, rank] > 0]

    def degree(self, rank: int, step: int = 0) -> int:
        return len(self.in_neighbors(rank, step))

    def is_uniform_complete(self, step: int = 0) -> bool:
        """``W = 11ᵀ / n``: gossip is exactly an all-reduce average (used as a fast path)."""
        w = self.mixing(step)
        return bool(torch.allclose(w, torch.full_like(w, 1.0 / self.n), atol=_TOL, rtol=0))

    def spectral_gap(self) -> float:
        """``1 - σ₂(W)``: how fast gossip mixes (1 for a complete graph, small for a long ring)."""
        s = torch.linalg.svdvals(self.weights)
        return float(1.0 - s[1]) if self.n > 1 else 1.0

    def __repr__(self) -> str:
        return f"Topology({self.name}, n={self.n}, spectral_gap={self.spectral_gap():.3f})"

    # -- constructors ------------------------------------------------------------------------------------------------
    @classmethod
    def from_graph(cls, graph: nx.Graph, name: str | None = None) -> Topology:
        """Metropolis-Hastings weights on a connected undirected networkx graph with nodes ``0..n-1``."""
        n = graph.number_of_nodes()
        if sorted(graph.nodes()) != list(range(n)):
            raise SettingsError(
                f"Topology.from_graph needs nodes 0..{n - 1} (the ranks), got {sorted(graph.nodes())[:8]}"
                "...; relabel with networkx.convert_node_labels_to_integers(graph)."
            )
        if n >= 2 and not nx.is_connected(graph):
            parts = [sorted(c) for c in nx.connected_components(graph)]
            raise SettingsError(
                f"The communication graph is not connected (components {parts}): the ranks of one "
                "component would never learn from the others. Add edges between the components."
            )
        return cls(metropolis_weights(graph, n), name or "graph")

    @classmethod
    def ring(cls, n: int) -> Topology:
        _check_n(n)
        return cls.from_graph(nx.cycle_graph(n), "ring")

    @classmethod
    def torus(cls, n: int, rows: int | None = None) -> Topology:
        """A ``rows x (n / rows)`` 2-D torus (default: the most square factorisation of ``n``)."""
        _check_n(n)
        if rows is None:
            rows = max(r for r in range(1, math.isqrt(n) + 1) if n % r == 0)
        if n % rows:
            raise SettingsError(f"Topology.torus: rows={rows} does not divide n={n}; choose a divisor of {n}.")
        grid = nx.Graph(nx.grid_2d_graph(rows, n // rows, periodic=True))  # Graph: no duplicate edges on short sides
        grid.remove_edges_from(nx.selfloop_edges(grid))
        return cls.from_graph(nx.convert_node_labels_to_integers(grid, ordering="sorted"), "torus")

    @classmethod
    def exponential(cls, n: int) -> Topology:
        """Static exponential graph: rank ``i`` sends to ``i + 2^k mod n`` for ``2^k < n``, and averages what it
        receives with itself uniformly (a circulant, so doubly stochastic)."""
        _check_n(n)
        offsets = [2**k for k in range(int(math.log2(n - 1)) + 1)] if n > 1 else []
        w = torch.zeros(n, n, dtype=torch.float64)
        for i in range(n):
            w[i, i] = 1.0
            for off in offsets:
                w[i, (i - off) % n] = 1.0
        return cls(w / (len(offsets) + 1), "exponential")

    @classmethod
    def fully_connected(cls, n: int) -> Topology:
        _check_n(n)
        return cls(torch.full((n, n), 1.0 / n, dtype=torch.float64), "fully_connected")

    @classmethod
    def named(cls, name: str, n: int, **kwargs) -> Topology:
        """``"ring"``, ``"torus"``, ``"exponential"``, ``"fully_connected"`` or ``"matcha"`` (``budget=``, ``seed=``,
        ``base=`` a base topology name)."""
        if name == "matcha":
            base = kwargs.pop("base", "torus")
            return MatchaTopology(cls.named(base, n), **kwargs)
        builders = {
            "ring": cls.ring,
            "torus": cls.torus,
            "exponential": cls.exponential,
            "fully_connected": cls.fully_connected,
        }
        if name not in builders:
            raise SettingsError(f"Unknown topology {name!r}; use one of {', '.join(list(builders) + ['matcha'])}.")
        return builders[name](n, **kwargs)


class MatchaTopology(Topology):
    """Time-varying graphs in the style of MATCHA: the base graph's edges are split into matchings (a greedy edge
    colouring); at step ``t`` every matching is active with probability ``budget``, and the active edges get
    Metropolis weights. Every rank draws the same matchings (the draw is seeded by ``seed`` and ``t``). The union of
    the matchings is the connected base graph, so gossip still reaches consensus in expectation; ``budget`` is the
    expected share of the base graph's messages that are sent."""

    def __init__(self, base: Topology, budget: float = 0.5, seed: int = 0):
        if not 0 < budget <= 1:
            raise SettingsError(
                f"MatchaTopology budget must be in (0, 1] (share of the base graph's matchings active per "
                f"step), got {budget!r}."
            )
        super().__init__(base.weights, f"matcha({base.name}, budget={budget})")
        graph = nx.Graph()
        graph.add_nodes_from(range(self.n))
        graph.add_edges_from(
            (i, j)
            for i in range(self.n)
            for j in range(self.n)
            if i < j and (base.weights[i, j] > 0 or base.weights[j, i] > 0)
        )
        colours = nx.greedy_color(nx.line_graph(graph), strategy="largest_first")
        self.matchings: list[list[tuple[int, int]]] = [[] for _ in range(max(colours.values(), default=-1) + 1)]
        for edge, c in sorted(colours.items()):
            self.matchings[c].append(tuple(sorted(edge)))
        self.budget, self.seed, self.base = budget, seed, base
        self._cache: dict[int, torch.Tensor] = {}

    def active_matchings(self, step: int) -> list[int]:
        rng = random.Random(self.seed * 1_000_003 + step)
        return [k for k in range(len(self.matchings)) if rng.random() < self.budget]

    def mixing(self, step: int = 0) -> torch.Tensor:
        if step not in self._cache:
            graph = nx.Graph()
            graph.add_nodes_from(range(self.n))
            for k in self.active_matchings(step):
                graph.add_edges_from(self.matchings[k])
            if len(self._cache) > 64:
                self._cache.clear()
            self._cache[step] = metropolis_weights(graph, self.n)
        return self._cache[step]

    def spectral_gap(self) -> float:
        """Of the expected mixing matrix over the matchings' draws (estimated from 64 steps)."""
        mean = sum(self.mixing(t) for t in range(64)) / 64
        return float(1.0 - torch.linalg.svdvals(mean)[1])


def _check_n(n) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 2:
        raise SettingsError(f"A topology needs n >= 2 ranks (world size 1 has nobody to gossip with), got n={n!r}.")


def _check_doubly_stochastic(w: torch.Tensor, name: str) -> None:
    if (w < -_TOL).any():
        raise SettingsError(f"Topology {name!r}: mixing weights must be >= 0, got a minimum of {float(w.min()):.3g}.")
    rows, cols = w.sum(1), w.sum(0)
    bad_rows = [i for i, s in enumerate(rows.tolist()) if abs(s - 1) > 1e-6]
    bad_cols = [j for j, s in enumerate(cols.tolist()) if abs(s - 1) > 1e-6]
    if bad_rows or bad_cols:
        found = [
            f"{what} {bad[:5]} sum to {[round(float(sums[k]), 4) for k in bad[:5]]}"
            for what, bad, sums in (("rows", bad_rows, rows), ("columns", bad_cols, cols))
            if bad
        ]
        raise SettingsError(
            f"Topology {name!r}: the mixing matrix must be doubly stochastic (every row and every column sums to 1, "
            f"so gossip keeps the average); {' and '.join(found)}. Use Topology.from_graph(graph) for "
            "Metropolis-Hastings weights."
        )


def _check_connected(w: torch.Tensor, name: str) -> None:
    graph = nx.DiGraph()
    n = w.shape[0]
    graph.add_nodes_from(range(n))
    graph.add_edges_from((j, i) for i in range(n) for j in range(n) if i != j and w[i, j] > _TOL)
    if not nx.is_strongly_connected(graph):
        parts = [sorted(c) for c in nx.strongly_connected_components(graph)]
        raise SettingsError(
            f"Topology {name!r}: the communication graph is not connected (components {parts}); the "
            "ranks of one component would never learn from the others."
        )
