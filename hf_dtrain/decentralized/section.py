"""This folder's ``--optimizer`` choices for the jobs: D-PSGD and DecentLaM (settings in ``--gossip.*``) and DiLoCo
(``--diloco.*``). Each exchanges parameters or gradients itself, so DDP runs its noop hook under them."""

from __future__ import annotations

from hf_dtrain.optimizers import OptimizerChoice, register_optimizer

from .config import DiLoCoConfig, GossipConfig


def _gossip(gossip, lr, weight_decay) -> dict:
    """The keywords both gossip optimizers take from ``--gossip.*`` and the job."""
    return dict(
        topology=gossip.topology,
        lr=lr,
        weight_decay=weight_decay,
        asynchronous=gossip.asynchronous,
        max_staleness=gossip.max_staleness,
    )


def _dpsgd(gossip, model, params, lr, weight_decay):
    from .dpsgd import DPSGD

    return DPSGD(params, mode=gossip.mode, base_optimizer="adamw", **_gossip(gossip, lr, weight_decay))


def _decentlam(gossip, model, params, lr, weight_decay):
    from .decentlam import DecentLaM

    return DecentLaM(params, momentum=gossip.momentum, **_gossip(gossip, lr, weight_decay))


def _diloco(d, model, params, lr, weight_decay):
    from .diloco import DiLoCo

    return DiLoCo(
        params,
        base_optimizer="adamw",
        sync_every=d.sync_every,
        outer_lr=d.outer_lr,
        outer_momentum=d.outer_momentum,
        outer_exchange=d.outer_exchange,
        lr=lr,
        weight_decay=weight_decay,
    )


GOSSIP_HELP = "The decentralized optimizers' settings (used with optimizer=dpsgd / decentlam)."
for _name, _build, _order in (("dpsgd", _dpsgd, 30), ("decentlam", _decentlam, 40)):
    register_optimizer(
        OptimizerChoice(
            _name,
            _build,
            help=_name,
            settings="gossip",
            defaults=GossipConfig,
            settings_help=GOSSIP_HELP,
            exchanges=True,
            asynchronous=lambda gossip: gossip.asynchronous,
            order=_order,
        )
    )
register_optimizer(
    OptimizerChoice(
        "diloco",
        _diloco,
        help="diloco (settings in diloco.*)",
        settings="diloco",
        defaults=DiLoCoConfig,
        settings_help="DiLoCo's settings (used with optimizer=diloco): H local AdamW steps, then an outer Nesterov "
        "step on the averaged pseudo-gradient.",
        exchanges=True,
        order=50,
    )
)
