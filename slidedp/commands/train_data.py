"""`slidedp train`'s data, eval, export and logging options (their own group; commands/train.py
merges the tables below into its own and calls these functions).

    --data-field F    the JSON key / data set column of a document (default "text"; "messages"
                      with --chat)
    --chat            documents are conversations, rendered with the tokenizer's chat template;
                      the loss is on assistant tokens only
    --pack            documents packed into rows with their boundaries (exec/packing.py)
    --eval-data PATH  held-out data (any --data source, read like it); its loss goes into the
                      metrics row as eval_loss
    --eval-every N    steps between eval losses (default 0: after the last step only)
    --save-dtype D    the dtype of final/ (default: --dtype)
    --report-to T     none | tensorboard | trackio, beside metrics.jsonl (exec/report.py)
A --model that is a Hugging Face model id in the local cache ("Qwen/Qwen3-4B") is replaced by its
snapshot directory before the resolved configuration is printed (exec/io/source.py).
"""

from __future__ import annotations

from slidedp.exec.dtypes import SAVE_DTYPES
from slidedp.exec.report import REPORT_TO

DEFAULTS = {"data_field": None, "chat": False, "pack": False, "eval_data": None,
            "eval_every": 0, "save_dtype": None, "report_to": "none"}
INTS = {"eval_every"}
BOOLS = {"chat", "pack"}
CHOICES = {"save_dtype": SAVE_DTYPES, "report_to": REPORT_TO}
MIN = {"eval_every": 0}


def add_options(p) -> None:
    g = p.add_argument_group("data, eval, export and logging")
    g.add_argument("--data-field", help="JSON key / data set column of a document (default "
                   "text; messages with --chat)")
    g.add_argument("--chat", action="store_true", help="conversations through the tokenizer's "
                   "chat template, loss on assistant tokens only")
    g.add_argument("--pack", action="store_true", help="pack documents into rows; attention "
                   "stays within each document")
    g.add_argument("--eval-data", help="held-out data (as --data) for the eval loss")
    g.add_argument("--eval-every", type=int, help="steps between eval losses (default 0: after "
                   "the last step only)")
    g.add_argument("--save-dtype", choices=SAVE_DTYPES,
                   help="dtype of final/ (default: --dtype)")
    g.add_argument("--report-to", choices=REPORT_TO,
                   help="also log to tensorboard or trackio (default none: metrics.jsonl only)")


def prepare(opts: dict) -> None:
    """Checks that read no data, in place: the tracker's package (one line, exit 2, before
    training), and a cached model id replaced by its snapshot directory."""
    from slidedp.exec import report
    from slidedp.exec.io.source import cached_model_dir

    report.check(opts["report_to"])
    snapshot = cached_model_dir(str(opts["model"]))
    if snapshot is not None:
        opts["model"] = str(snapshot)


def data_options(opts: dict):
    from slidedp.exec.data import DataOptions

    return DataOptions(field=opts["data_field"], chat=opts["chat"], pack=opts["pack"])


def config_fields(opts: dict) -> dict:
    """TrainConfig's fields for these options."""
    return {"data_options": data_options(opts), "eval_data": opts["eval_data"],
            "eval_every": opts["eval_every"], "save_dtype": opts["save_dtype"],
            "report_to": opts["report_to"]}


def precheck(opts: dict, tokenizer_dir) -> None:
    """The data's and the eval data's checks that read no data (exec/data.py precheck_tokens)."""
    from slidedp.exec.data import precheck_tokens

    for path in (opts["data"], opts["eval_data"]):
        if path is not None:
            precheck_tokens(path, opts["seq"], tokenizer_dir, data_options(opts))


def data_line(data) -> str:
    """One line on the rows a run trains on (exec/data.py TokenSequences)."""
    kind = ("packed" if data.position_ids is not None else
            "one document a row" if data.labels is not None else "token rows")
    docs = f", {data.documents} documents" if data.documents else ""
    dropped = f", {data.dropped_tokens} tail tokens dropped" if data.dropped_tokens else ""
    return f"data {data.where}: {len(data)} rows of {data.tokens.shape[1]} tokens ({kind}{docs}){dropped}"


def reporter(cfg):
    """The tracker of cfg.report_to (exec/report.py), None for none."""
    if cfg.report_to == "none":
        return None
    from slidedp.exec.report import Reporter

    keys = ("data", "seq", "global_batch", "micro_batch", "steps", "dtype", "device", "seed",
            "eval_data", "eval_every")
    config = {k: str(getattr(cfg, k)) for k in keys} | {"lr": cfg.optimizer.lr}
    return Reporter(cfg.report_to, cfg.out, config)
