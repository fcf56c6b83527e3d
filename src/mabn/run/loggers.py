"""The run's loggers: a CSV log that survives resumes and kills, a WandbLogger that never hangs or crashes for
want of a network or a login and continues the same wandb run after a restart, and a TensorBoardLogger that
writes into the run's folder like the CSV log."""

from __future__ import annotations

import csv
import netrc
import os
import secrets
import sys
from pathlib import Path
from typing import Any

from lightning_fabric.loggers.tensorboard import _TENSORBOARD_AVAILABLE, _TENSORBOARDX_AVAILABLE
from lightning_fabric.utilities.logger import _convert_params
from pytorch_lightning.core.saving import save_hparams_to_yaml
from pytorch_lightning.loggers import CSVLogger as _CSVLogger
from pytorch_lightning.loggers import TensorBoardLogger as _TensorBoardLogger
from pytorch_lightning.loggers import WandbLogger as _WandbLogger
from pytorch_lightning.loggers.csv_logs import ExperimentWriter
from pytorch_lightning.loggers.logger import DummyExperiment

from ..errors import ConfigError
from .files import first_line, write_atomic, write_text_atomic

ID_FILE = "wandb-id"


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
    and ``data:<dataset>``, from ``stage`` and ``dataset`` (``python -m mabn <stage>`` sets both), the task's
    hyperparameters (``norm``, ``decoder``) and ``save_dir``; a part that is unknown is left out (a plain
    ``python -m mabn fit`` has no stage; the dataset is then the name of the data's ``data_dir``). A ``name`` or
    ``group`` given wins, and ``tags`` given are added to these. In a fit the run starts when Lightning logs the
    hyperparameters, after the setup hooks."""

    def __init__(
        self,
        project: str = "mabn",
        save_dir: str = "runs",
        offline: bool | None = None,
        id: str | None = None,
        online_timeout: float = 45.0,
        stage: str | None = None,
        dataset: str | None = None,
        **kwargs: Any,
    ):
        if offline is None:
            offline = "WANDB_MODE" not in os.environ and not wandb_ready()
        if id is None:
            id = run_id(Path(save_dir))
        # wandb's own bound on wandb.init (default 90 s); settings given as a dict may still set it themselves
        if isinstance(kwargs.get("settings", {}), dict):
            kwargs["settings"] = {"init_timeout": online_timeout, **kwargs.get("settings", {})}
        super().__init__(project=project, save_dir=save_dir, offline=offline, id=id, resume="allow", **kwargs)
        # Lightning passes anonymous=None to wandb.init, which wandb answers with a deprecation warning line in
        # front of a failing run's one-line error; unset, wandb says nothing.
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)
        self._stage, self._dataset = stage, dataset
        self._hparams: dict[str, Any] = {}

    def run_identity(self) -> dict[str, Any]:
        """The run's ``name``, ``group`` and ``tags`` for ``wandb.init`` (see the class's doc)."""
        hp, init = self._hparams, self._wandb_init
        dataset = self._dataset or (Path(str(hp["data_dir"])).name if hp.get("data_dir") else None)
        norm, decoder = hp.get("norm"), hp.get("decoder")
        folder = Path(str(self._save_dir)).resolve().name if self._save_dir else None
        facts = {"stage": self._stage, "norm": norm, "decoder": decoder, "data": dataset}
        tags = [f"{key}:{value}"[:64] for key, value in facts.items() if value]  # wandb's limit: 64 characters
        return {
            "name": init.get("name") or "-".join(str(p) for p in (self._stage, norm, folder) if p) or None,
            "group": init.get("group") or "-".join(str(p) for p in (self._stage, norm, decoder, dataset) if p) or None,
            "tags": list(dict.fromkeys([*tags, *(init.get("tags") or [])])) or None,
        }

    def log_hyperparams(self, params: Any) -> None:
        # Lightning logs the task's (and the data's) hyperparameters first thing in a fit: they name the run.
        self._hparams = dict(_convert_params(params) or {})
        super().log_hyperparams(params)

    @property
    def experiment(self):
        import wandb

        if self._experiment is None and not self._hparams and sys._getframe(1).f_code.co_name == "_call_setup_hook":
            # Lightning starts the loggers' experiments before the setup hooks, for their metadata (this logger's
            # version is its id, known already); the run starts at log_hyperparams instead, named after them.
            return DummyExperiment()
        if self._experiment is None:
            self._wandb_init.update(self.run_identity())
            self._name = self._wandb_init["name"]
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
        self._wandb_init["mode"] = "offline"
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


class _AppendingWriter(ExperimentWriter):
    """Lightning's CSV writer, but a resumed run keeps the rows already in ``metrics.csv`` (Lightning's deletes
    the file of a non-empty log folder), and every save rewrites the file whole through a temporary file, so
    a kill never leaves a cut-off row or header."""

    def _check_log_dir_exists(self) -> None:
        pass  # the experiment folder belongs to this run (mabn.run.folder): its metrics are kept, never deleted

    def save(self) -> None:
        write_atomic(Path(self.log_dir) / self.NAME_HPARAMS_FILE, lambda tmp: save_hparams_to_yaml(tmp, self.hparams))
        if not self.metrics:
            return
        path = Path(self.metrics_file_path)
        rows: list[dict[str, Any]] = []
        if path.is_file():
            with open(path, newline="") as file:
                reader = csv.DictReader(file)
                rows = list(reader)
                self.metrics_keys = sorted(set(self.metrics_keys) | set(reader.fieldnames or []))
        self._record_new_keys()
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
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment


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
        """A ``ConfigError`` where neither tensorboard nor tensorboardX is installed. ``mabn.cli.lightning`` asks
        before a fit starts: Lightning's own ModuleNotFoundError comes once the classes are built, and jsonargparse
        reports it inside a traceback."""
        if not (_TENSORBOARD_AVAILABLE or _TENSORBOARDX_AVAILABLE):
            raise ConfigError(
                "mabn.run.loggers.TensorBoardLogger needs the tensorboard package, which is not installed: "
                "pip install 'mabn[tensorboard]' (or tensorboard)"
            )
