"""Admin HTTP API over the rollout policy, behind a bearer token.

Endpoints (all need `Authorization: Bearer <token>`; a missing or wrong token is 401, and when the
server was started without --admin-token / SPECSERVE_ADMIN_TOKEN the admin API is off: 403):
- GET  /admin/profiles   profiles, weights, fractions, whether reverted to baseline, version.
- PUT  /admin/weights    body {"weights": {name: number}}: replaces all weights (missing names get 0),
                         ends a revert to baseline. 400 for unknown names, negative numbers or an all-zero set.
- POST /admin/rollback   revert to baseline: all new traffic (explicit overrides too) to `baseline`.
Changes apply to the next request; running requests keep the profile they started with.
What it does not do: authentication beyond one shared token, audit storage (changes are logged).
"""

from __future__ import annotations

import hmac
import json
import logging

from fastapi import APIRouter, Request

from specserve.config import ConfigError
from specserve.rollout.policy import RolloutPolicy
from specserve.server.errors import APIError

logger = logging.getLogger("specserve.admin")


def admin_router(policy: RolloutPolicy, token: str | None) -> APIRouter:
    router = APIRouter(prefix="/admin")

    def check(request: Request) -> None:
        if not token:
            raise APIError(403, "the admin API is disabled: start the server with --admin-token", code="admin_disabled")
        auth = request.headers.get("authorization", "")
        scheme, _, given = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise APIError(
                401, "missing or wrong admin token (send Authorization: Bearer <token>)",
                code="invalid_admin_token", headers={"WWW-Authenticate": "Bearer"},
            )

    @router.get("/profiles")
    async def get_profiles(request: Request):
        check(request)
        return policy.state()

    @router.put("/weights")
    async def put_weights(request: Request):
        check(request)
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"invalid JSON: {e}") from None
        if not isinstance(body, dict) or "weights" not in body:
            raise APIError(400, 'body must be {"weights": {profile: number}}', param="weights")
        try:
            state = policy.set_weights(body["weights"])
        except ConfigError as e:
            raise APIError(400, str(e), param="weights") from None
        logger.warning("admin: weights set to %s (version %d)", state["weights"], state["version"])
        return state

    @router.post("/rollback")
    async def rollback(request: Request):
        check(request)
        state = policy.revert_to_baseline()
        logger.warning("admin: reverted to baseline (version %d)", state["version"])
        return state

    return router
