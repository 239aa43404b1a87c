"""The OpenAI frontend's view of Triton (frontend/openai_api/triton_client.py), faked for
tests without a server: the served models, looked up as the real client does."""

from frontend.openai_api.errors import APIError


class FakeTriton:
    # The gRPC client the routes hand each request (its calls are faked where a test needs them).
    client = None
    health = None                       # no supervisor's backend watch (backend_health.py)

    def __init__(self, models):
        self._models = models

    async def models(self):
        return self._models

    async def model(self, name):
        if name not in self._models:
            raise APIError(404, f"The model '{name}' does not exist", "model")
        return self._models[name]

    async def close(self):
        pass
