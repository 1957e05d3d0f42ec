"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, and its status codes.

Every refusal the server makes is an `APIError`; the app turns it (and the framework's own
404/405) into this body, so a client never sees FastAPI's 422 or an HTML page.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

# status -> OpenAI's error type
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        headers = dict(headers or {})
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, int(-(-self.retry_after // 1))))  # ceil, >= 1
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None):
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)
