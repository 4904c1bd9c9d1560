"""The OpenAI error shape: `ApiError` is what every layer raises to refuse a request, and
`error_body` the JSON it becomes, `{"error": {"message", "type", "param", "code"}}`. Pure Python.
"""

from __future__ import annotations


class ApiError(Exception):
    """A request the API refuses; rendered as `{"error": {...}}` with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or error_type(status)
        self.headers = headers or {}  # extra response headers, e.g. Retry-After on a 503

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_type(status: int) -> str:
    """The OpenAI error `type` for an HTTP status."""
    if status == 429:
        return "rate_limit_exceeded"
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
