"""The run's loggers: a CSV log that survives resumes and kills, a WandbLogger that never hangs or crashes for
want of a network or a login and continues the same wandb run after a restart, and a TensorBoardLogger that
writes into the run's folder like the CSV log."""

from __future__ import annotations

import csv
import importlib.util
import netrc
import os
import secrets
import sys
from pathlib import Path
from typing import Any

from pytorch_lightning.core.saving import save_hparams_to_yaml
from pytorch_lightning.loggers import CSVLogger as _CSVLogger
from pytorch_lightning.loggers import TensorBoardLogger as _TensorBoardLogger
from pytorch_lightning.loggers import WandbLogger as _WandbLogger
from torch import Tensor

from ..compat import csv_writer, set_csv_writer, wandb_init_args
from ..errors import ConfigError
from .files import first_line, write_atomic, write_text_atomic

ID_FILE = "wandb-id"
# What Lightning's TensorBoardLogger needs: the tensorboard package or tensorboardX.
TENSORBOARD_INSTALLED = any(importlib.util.find_spec(name) is not None for name in ("tensorboard", "tensorboardX"))


def wandb_ready() -> bool:
    """True when this machine can log online: an API key in the environment or a saved ``wandb login``."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def run_id(folder: Path) -> str:
    """The wandb run id kept in ``folder/wandb-id``: created by the first process that asks (linked into place,
    so two processes racing agree on one id), read back by every later one and by every resume."""
    path = folder / ID_FILE
    if not path.is_file():
        tmp = write_text_atomic(folder / f".{ID_FILE}.{os.getpid()}", secrets.token_hex(4))
        try:
            os.link(tmp, path)  # fails when another process created it first: its id wins
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return path.read_text().strip()


class WandbLogger(_WandbLogger):
    """Lightning's WandbLogger, offline unless wandb is set up, so a run without network or login still
    finishes (``wandb sync <run folder>/wandb/offline-run-*`` uploads it later). ``WANDB_MODE`` (offline,
    online, disabled) always wins. Without an ``id`` it uses the one kept in ``save_dir`` (``run_id``) with
    ``resume="allow"``, so a resumed run continues the same wandb run. Summary metrics: the best ``val/miou``
    and ``val/top1`` of the run.

    An online start that fails (server unreachable or not answering within ``online_timeout`` seconds, wandb's
    ``init_timeout``; a refused key) never ends the training: the run goes on offline, same id and folder, and
    one line says which folder to ``wandb sync`` later. wandb's login adds up to 10 s to the timeout when the
    server does not answer (two 5 s look-ups of the account, fixed in wandb).

    The run is named ``<stage>-<norm>-<run folder name>`` (e.g. ``cityscapes-mabn-mabn``), grouped by
    ``<stage>-<norm>-<decoder>-<dataset>`` and tagged ``stage:<stage>``, ``norm:<norm>``, ``decoder:<decoder>``
    and ``data:<dataset>`` (``run_identity``), from ``stage``, ``dataset``, ``norm``, ``decoder`` and ``save_dir``;
    a part that is unknown is left out. ``python -m mabn`` gives them from the parsed configuration: a stage
    launch sets ``stage`` and ``dataset``, and every run the task's ``norm`` and ``decoder`` and, where no
    ``dataset`` is given (a plain ``python -m mabn fit`` has no stage), the name of the data's ``data_dir``. A
    ``name`` or ``group`` given wins, and ``tags`` given are added to these."""

    def __init__(
        self,
        project: str = "mabn",
        save_dir: str = "runs",
        offline: bool | None = None,
        id: str | None = None,
        online_timeout: float = 45.0,
        stage: str | None = None,
        dataset: str | None = None,
        norm: str | None = None,
        decoder: str | None = None,
        **kwargs: Any,
    ):
        if offline is None:
            offline = "WANDB_MODE" not in os.environ and not wandb_ready()
        if id is None:
            id = run_id(Path(save_dir))
        # wandb's own bound on wandb.init (default 90 s); settings given as a dict may still set it themselves
        if isinstance(kwargs.get("settings", {}), dict):
            kwargs["settings"] = {"init_timeout": online_timeout, **kwargs.get("settings", {})}
        facts = {"stage": stage, "norm": norm, "decoder": decoder, "data": dataset}
        kwargs.update(run_identity(save_dir, facts, kwargs.get("name"), kwargs.get("group"), kwargs.get("tags")))
        super().__init__(project=project, save_dir=save_dir, offline=offline, id=id, resume="allow", **kwargs)
        # Lightning passes anonymous=None to wandb.init, which wandb answers with a deprecation warning line in
        # front of a failing run's one-line error; unset, wandb says nothing.
        if wandb_init_args(self).get("anonymous") is None:
            wandb_init_args(self).pop("anonymous", None)

    @property
    def experiment(self):
        import wandb

        try:
            run = super().experiment
        except (wandb.Error, TimeoutError) as err:  # CommError, AuthenticationError, UsageError; or wandb's own wait
            run = self._go_offline(err)
        if getattr(run, "define_metric", None) is not None and not getattr(self, "_summaries_defined", False):
            for key in ("val/miou", "val/top1"):
                run.define_metric(key, summary="max")
            self._summaries_defined = True
        return run

    def _go_offline(self, err: BaseException):
        """The same run (id, folder) started again offline: wandb's init argument ``mode`` wins over
        ``WANDB_MODE`` and needs no login. Only the process that started wandb gets here (rank zero)."""
        import wandb

        # wandb's service keeps the failed start's run for a few seconds ("run ID ... is in use" to a second
        # wandb.init): ending the service ends it, and the next wandb.init starts a new one (0-4 s in all).
        wandb.teardown()
        wandb_init_args(self)["mode"] = "offline"
        run = super().experiment  # Lightning's path again: wandb.init, then its step metric definitions
        folder = Path(run.settings.sync_dir)
        if folder.is_relative_to(Path.cwd()):
            folder = folder.relative_to(Path.cwd())
        print(
            f"wandb: no online run at {run.settings.base_url} ({type(err).__name__}: {first_line(err)}): logging"
            f" offline to {folder}; upload it later with: wandb sync {folder}",
            file=sys.stderr,
            flush=True,
        )
        return run


def run_identity(
    save_dir: str | None, facts: dict[str, str | None], name: str | None, group: str | None, tags: list[str] | None
) -> dict[str, Any]:
    """A wandb run's ``name``, ``group`` and ``tags`` (see ``WandbLogger``) from the run's ``save_dir`` and its
    ``facts`` (``stage``, ``norm``, ``decoder``, ``data``: each a name or None), the ``name`` and ``group`` given
    winning and the ``tags`` given added."""
    stage, norm, decoder, dataset = (facts.get(key) for key in ("stage", "norm", "decoder", "data"))
    folder = Path(str(save_dir)).resolve().name if save_dir else None
    made = [f"{key}:{value}"[:64] for key, value in facts.items() if value]  # wandb's limit: 64 characters
    return {
        "name": name or "-".join(str(p) for p in (stage, norm, folder) if p) or None,
        "group": group or "-".join(str(p) for p in (stage, norm, decoder, dataset) if p) or None,
        "tags": list(dict.fromkeys([*made, *(tags or [])])) or None,
    }


class _AppendingWriter:
    """The CSV writer Lightning's ``CSVLogger`` calls (``log_hparams``, ``log_metrics``, ``save``), but a resumed
    run keeps the rows already in ``metrics.csv`` (Lightning's writer deletes the file of a non-empty log folder:
    the folder belongs to this run, mabn.run.folder), and every save rewrites the file whole through a temporary
    file, so a kill never leaves a cut-off row or header. Lightning saves at every logging step; ``hparams.yaml``
    is written at the first save and after ``log_hparams`` only (two fsyncs a step fewer, which a cluster's network
    filesystem takes milliseconds each)."""

    NAME_HPARAMS_FILE = "hparams.yaml"

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.metrics_file_path = os.path.join(log_dir, "metrics.csv")
        self.metrics: list[dict[str, Any]] = []
        self.metrics_keys: list[str] = []
        self.hparams: dict[str, Any] = {}
        self._hparams_unsaved = True
        os.makedirs(log_dir, exist_ok=True)

    def log_hparams(self, params: dict[str, Any]) -> None:
        self.hparams.update(params)
        self._hparams_unsaved = True
        self.save_hparams()

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        row = {k: v.item() if isinstance(v, Tensor) else v for k, v in metrics.items()}
        if "epoch" in row:  # a validation logs its epoch as the mean over its batches, a float
            row["epoch"] = int(row["epoch"])
        self.metrics.append({**row, "step": len(self.metrics) if step is None else step})

    def save_hparams(self) -> None:
        if not self._hparams_unsaved:
            return
        write_atomic(Path(self.log_dir) / self.NAME_HPARAMS_FILE, lambda tmp: save_hparams_to_yaml(tmp, self.hparams))
        self._hparams_unsaved = False

    def save(self) -> None:
        self.save_hparams()
        if not self.metrics:
            return
        path = Path(self.metrics_file_path)
        rows: list[dict[str, Any]] = []
        if path.is_file():
            with open(path, newline="") as file:
                reader = csv.DictReader(file)
                rows = list(reader)
                self.metrics_keys = sorted(set(self.metrics_keys) | set(reader.fieldnames or []))
        self.metrics_keys = sorted(set(self.metrics_keys).union(*self.metrics))
        rows += self.metrics

        def write(tmp: Path) -> None:
            with open(tmp, "w", newline="") as file:
                writer = csv.DictWriter(file, fieldnames=self.metrics_keys)
                writer.writeheader()
                writer.writerows(rows)

        write_atomic(path, write)
        self.metrics = []


class CSVLogger(_CSVLogger):
    """Lightning's CSVLogger writing ``metrics.csv`` and ``hparams.yaml`` straight into ``save_dir`` (the run's
    folder: no ``name/version_N`` below it), appending across resumes, each save atomic."""

    def __init__(self, save_dir: str, name: str = "", version: str = "", **kwargs: Any) -> None:
        super().__init__(save_dir, name=name, version=version, **kwargs)

    @property
    def experiment(self) -> _AppendingWriter:
        if csv_writer(self) is None:  # the writer Lightning's finalize saves
            set_csv_writer(self, _AppendingWriter(log_dir=self.log_dir))
        return csv_writer(self)


class TensorBoardLogger(_TensorBoardLogger):
    """Lightning's TensorBoardLogger writing its event files straight into ``save_dir`` (the run's folder, as
    ``CSVLogger``: no ``name/version_N`` below it), so the events of a resumed run join those before it and
    ``tensorboard --logdir runs`` shows each run folder as one run. No ``hp_metric`` placeholder (Lightning's
    default logs -1 under that name). Needs the ``tensorboard`` package (``pip install 'mabn[tensorboard]'``) or
    tensorboardX, as Lightning's does (``check_installed``)."""

    def __init__(
        self, save_dir: str = "runs", name: str = "", version: str = "", default_hp_metric: bool = False, **kwargs: Any
    ) -> None:
        self.check_installed()
        super().__init__(save_dir, name=name, version=version, default_hp_metric=default_hp_metric, **kwargs)

    @staticmethod
    def check_installed() -> None:
        """A ``ConfigError`` where neither tensorboard nor tensorboardX is installed. A fit asks before it starts
        (``mabn.cli.fit.check_loggers``): Lightning's own ModuleNotFoundError comes once the classes are built, and
        jsonargparse reports it inside a traceback."""
        if not TENSORBOARD_INSTALLED:
            raise ConfigError(
                "mabn.run.loggers.TensorBoardLogger needs the tensorboard package, which is not installed: "
                "pip install 'mabn[tensorboard]' (or tensorboard)"
            )
