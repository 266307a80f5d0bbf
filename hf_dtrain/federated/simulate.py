"""The simulation loop: N clients on P processes (FedML Parrot's decomposition).

Each round the server samples ``per_round`` clients (seeded), deals them to the processes in proportion to each
process's measured speed (the heterogeneity-aware partitioner's quota rule, :func:`hf_dtrain.distributed
.speed_quotas`), and every process trains its clients one after another on one model: load the global adapter, run
``local_steps`` optimizer steps on the client's own data (continuing where its previous round stopped), take the
delta, compress it for the uplink, add it to the process's local sum. One all-reduce per round sums the processes'
partial sums (the server receives P updates, not N) and every process applies the same server step, so the global
adapter stays identical on every process without a broadcast.

A client's state between its rounds lives in :class:`~hf_dtrain.federated.state.ClientStateStore`: SCAFFOLD's control
variate, the uplink's error-feedback residual, the optimizer state (``keep_client_optimizer``) and its data position.
A client that raises during its round is left out of that round's aggregation and reported in the round's record.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from hf_dtrain.distributed.quotas import speed_quotas
from hf_dtrain.errors import SettingsError

from .aggregate import global_average, local_aggregate
from .compress import compress_delta
from .config import FederatedConfig
from .state import ClientStateStore


class FederatedSimulation:
    """Simulate ``config.clients`` clients whose data are ``client_data`` (one dataset per client), training the
    trainable parameters of ``model`` (a peft model: its adapter is the payload)."""

    def __init__(
        self,
        model,
        client_data: list,
        collator: Callable,
        config: FederatedConfig,
        state_dir: str | None = None,
        eval_fn: Callable | None = None,
    ) -> None:
        if len(client_data) != config.clients:
            raise SettingsError(f"{len(client_data)} client datasets for FederatedConfig.clients={config.clients}.")
        self.model, self.data, self.collator, self.cfg = model, client_data, collator, config
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if not self.params:
            raise SettingsError("the model has no trainable parameter: wrap it with get_peft_model first.")
        self.global_state = {n: p.detach().float().clone() for n, p in self.params.items()}
        self.control = {n: torch.zeros_like(v) for n, v in self.global_state.items()}  # SCAFFOLD's server c
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        if self.world > 1 and state_dir is None:
            raise SettingsError(
                "a multi-process simulation needs state_dir: a directory all processes share, where each "
                "client's state lives between rounds (any process may train a client next)."
            )
        self.store = ClientStateStore(state_dir)
        self.eval_fn = eval_fn
        self.speeds = [1.0] * self.world  # clients per second of each process, measured each round
        self.history: list[dict] = []

    # --- the plan of a round -------------------------------------------------------------------------------------
    def sample(self, round_index: int) -> list[int]:
        gen = torch.Generator().manual_seed(self.cfg.seed * 100_003 + round_index)
        return sorted(torch.randperm(self.cfg.clients, generator=gen)[: self.cfg.per_round].tolist())

    def assign(self, clients: list[int]) -> list[list[int]]:
        """The round's clients dealt to the processes in proportion to their measured speeds."""
        quotas = speed_quotas(len(clients), self.speeds)
        out, start = [], 0
        for q in quotas:
            out.append(clients[start : start + q])
            start += q
        return out

    def client_order(self, client: int, epoch: int) -> list[int]:
        """The order in which ``client`` visits its samples in its ``epoch``-th pass (seeded per client)."""
        gen = torch.Generator().manual_seed((self.cfg.seed * 1_000_003 + client) * 1009 + epoch)
        return torch.randperm(len(self.data[client]), generator=gen).tolist()

    # --- one client ----------------------------------------------------------------------------------------------
    def _batches(self, client: int, meta: dict):
        """The client's next micro-batches, continuing from ``meta`` (epoch, position), which it updates."""
        data, b = self.data[client], self.cfg.batch_size
        while True:
            order = self.client_order(client, meta.get("epoch", 0))
            pos = meta.get("position", 0)
            while pos < len(order):
                idx = order[pos : pos + b]
                pos += len(idx)
                meta["position"] = pos
                yield self.collator([data[i] for i in idx])
            meta["epoch"], meta["position"] = meta.get("epoch", 0) + 1, 0

    def _optimizer(self):
        params = list(self.params.values())
        if self.cfg.client_optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.cfg.client_lr)
        return torch.optim.AdamW(params, lr=self.cfg.client_lr, weight_decay=0.0)

    def train_client(self, client: int) -> tuple[dict, dict, float, int, float]:
        """``(received delta, control-variate delta, weight, uplink bytes, mean loss)`` of one client's round."""
        cfg = self.cfg
        tensors, meta = self.store.load(client)
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.global_state[n].to(p.dtype))
        opt = self._optimizer()
        if cfg.keep_client_optimizer and meta.get("optimizer"):
            state = {
                int(i): {k: tensors[f"opt.{i}.{k}"] for k in keys} for i, keys in meta["optimizer"]["keys"].items()
            }
            opt.load_state_dict({"state": state, "param_groups": meta["optimizer"]["groups"]})
        c_i = {n: tensors.get(f"control.{n}", torch.zeros_like(v)) for n, v in self.global_state.items()}
        device = next(iter(self.params.values())).device
        batches = self._batches(client, meta)
        losses = []
        self.model.train()
        for _ in range(cfg.local_steps):
            batch = {k: v.to(device) for k, v in next(batches).items()}
            loss = self.model(**batch).loss
            losses.append(loss.item())
            if cfg.algorithm == "fedprox" and cfg.prox_mu > 0:
                prox = sum(((p.float() - self.global_state[n].to(device)) ** 2).sum() for n, p in self.params.items())
                loss = loss + 0.5 * cfg.prox_mu * prox
            loss.backward()
            if cfg.algorithm == "scaffold":  # y <- y - lr (g - c_i + c)
                for n, p in self.params.items():
                    p.grad.add_((self.control[n] - c_i[n]).to(device=device, dtype=p.grad.dtype))
            opt.step()
            opt.zero_grad(set_to_none=True)
        delta = {n: p.detach().float().cpu() - self.global_state[n] for n, p in self.params.items()}
        new = {}
        dc = {}
        if cfg.algorithm == "scaffold":  # option II of the paper: c_i+ = c_i - c + (x - y_i) / (K lr)
            for n in delta:
                c_new = c_i[n] - self.control[n] - delta[n] / (cfg.local_steps * cfg.client_lr)
                dc[n] = c_new - c_i[n]
                new[f"control.{n}"] = c_new
        residual = None
        if cfg.uplink != "none" and cfg.error_feedback:
            residual = {n: tensors.get(f"residual.{n}", torch.zeros_like(v)) for n, v in delta.items()}
        received, sent, residual = compress_delta(delta, cfg.uplink, cfg.uplink_rank, residual)
        if residual is not None:
            new.update({f"residual.{n}": v for n, v in residual.items()})
        if cfg.keep_client_optimizer:
            sd = opt.state_dict()
            keys = {}
            for i, st in sd["state"].items():
                keys[str(i)] = []
                for k, v in st.items():
                    new[f"opt.{i}.{k}"] = torch.as_tensor(v)
                    keys[str(i)].append(k)
            meta["optimizer"] = {"keys": keys, "groups": sd["param_groups"]}
        meta["rounds"] = meta.get("rounds", 0) + 1
        self.store.save(client, new, meta)
        return received, dc, float(len(self.data[client])), sent, sum(losses) / len(losses)

    # --- one round -----------------------------------------------------------------------------------------------
    def round(self, round_index: int) -> dict:
        cfg = self.cfg
        sampled = self.sample(round_index)
        mine = self.assign(sampled)[self.rank]
        deltas, dcs, weights, failed, losses = [], [], [], [], []
        sent = 0
        t0 = time.perf_counter()
        for client in mine:
            try:
                d, dc, w, b, loss = self.train_client(client)
            except Exception as e:  # the round completes without it, and says so
                failed.append((client, f"{type(e).__name__}: {e}"))
                continue
            deltas.append(d)
            dcs.append(dc)
            weights.append(w)
            sent += b
            losses.append(loss)
        seconds = time.perf_counter() - t0
        names = list(self.global_state)
        sums, weight = local_aggregate(deltas, weights, names) if deltas else (dict.fromkeys(names), 0.0)
        sums = {
            n: (v if v is not None else torch.zeros_like(self.global_state[n], dtype=torch.float64))
            for n, v in sums.items()
        }
        dc_sum = (
            {n: sum((d[n] for d in dcs), torch.zeros_like(self.global_state[n])) for n in names}
            if cfg.algorithm == "scaffold"
            else {}
        )
        failed_mask = torch.zeros(cfg.clients, dtype=torch.float64)
        for c, _ in failed:
            failed_mask[c] = 1
        stats = torch.tensor(
            [weight, float(sent), float(sum(losses)), float(len(losses)), seconds / max(1, len(mine))],
            dtype=torch.float64,
        )
        if self.world > 1:  # Parrot's global step: one sum of the processes' partial sums
            flat = torch.cat([sums[n].reshape(-1) for n in names] + [failed_mask, stats[:4]])
            dist.all_reduce(flat)
            off = 0
            for n in names:
                k = sums[n].numel()
                sums[n] = flat[off : off + k].view_as(sums[n])
                off += k
            failed_mask = flat[off : off + cfg.clients]
            stats[:4] = flat[off + cfg.clients : off + cfg.clients + 4]
            speeds = torch.zeros(self.world, dtype=torch.float64)
            speeds[self.rank] = 1.0 / max(stats[4].item(), 1e-9)
            dist.all_reduce(speeds)
            self.speeds = speeds.tolist()
            for n in dc_sum:
                dist.all_reduce(dc_sum[n])
            weight = float(stats[0])
        failed_clients = [i for i in range(cfg.clients) if failed_mask[i] > 0]
        if weight > 0:
            avg = global_average([(sums, weight)])
            for n in names:
                self.global_state[n] += cfg.server_lr * avg[n]
        for n in dc_sum:  # c <- c + (1/N) sum_i dc_i
            self.control[n] += dc_sum[n] / cfg.clients
        record = dict(
            round=round_index + 1,
            clients=sampled,
            trained=len(sampled) - len(failed_clients),
            seconds=time.perf_counter() - t0,
            failed=failed_clients,
            uplink_bytes=int(stats[1]),
            train_loss=float(stats[2] / stats[3]) if stats[3] > 0 else math.nan,
            failures=[f"client {c}: {why}" for c, why in failed],
        )
        if self.eval_fn is not None:
            self.load_global()
            record["eval_loss"] = float(self.eval_fn(self.model))
        self.history.append(record)
        return record

    def load_global(self) -> None:
        """Put the global adapter into the model."""
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.global_state[n].to(p.dtype))

    def run(self, progress: bool = True) -> list[dict]:
        with tqdm(total=self.cfg.rounds, desc="federated rounds", disable=not progress or self.rank != 0) as bar:
            for r in range(self.cfg.rounds):
                rec = self.round(r)
                bar.update(1)
                bar.set_postfix(loss=f"{rec['train_loss']:.3f}", failed=len(rec["failed"]), refresh=False)
        self.load_global()
        return self.history
