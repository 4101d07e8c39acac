"""The server's one error type: every refusal is an OpenAI-style JSON body with a 4xx status (5xx
only for a bug or a shutdown)."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class ApiError(Exception):
    """An error answered as HTTP `status` with an OpenAI-style body:
    {"error": {"message": ..., "type": ..., "code": ..., "param": ...}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)
