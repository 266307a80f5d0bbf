"""The run machinery the jobs share: sections (:mod:`.section`: one per engine, with its settings, clashes and hooks,
and the registry that finds them), job configs built from the registries (:mod:`.config`), flags and recipes from
them (:mod:`.flags`), and :class:`~hf_dtrain.run.job.JobRun`, which runs a job over its active sections. Light to
import; it names no section and imports no engine."""
