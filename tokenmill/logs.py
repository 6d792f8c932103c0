"""Structured logs (`--log-format json`): one JSON object a line, the request id on every request-scoped line.

The request id travels in a context variable: a frontend handler sets it when it names the request (it then holds for
everything that handler and its tasks log); a process that logs about a request outside such a context passes it as
`extra={"request_id": ...}`. Every process picks the format from LOG_FORMAT_ENV, which the frontend sets before it
starts the scheduler and the workers (they set up logging before they have read the config).
"""

from __future__ import annotations

import json
import logging
import time
from contextvars import ContextVar

LOG_FORMAT_ENV = "TOKENMILL_LOG_FORMAT"
LOG_FORMATS = ("text", "json")

request_id_var: ContextVar[str | None] = ContextVar("tokenmill_request_id", default=None)


class JsonFormatter(logging.Formatter):
    """A record as one JSON line: time (UTC, ISO 8601), level, process, logger, message, request_id when known,
    exception when there is one."""

    def __init__(self, process_name: str) -> None:
        super().__init__()
        self.process_name = process_name

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "process": self.process_name,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or request_id_var.get()
        if request_id is not None:
            entry["request_id"] = request_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def log_formatter(process_name: str, log_format: str) -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter(process_name)
    return logging.Formatter(f"%(levelname)s %(asctime)s [{process_name}] %(message)s", datefmt="%m-%d %H:%M:%S")
