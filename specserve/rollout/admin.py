"""Admin HTTP API over the rollout policy and the staged-rollout controller, behind a bearer token.

Endpoints (all need `Authorization: Bearer <token>`; a missing or wrong token is 401, and when the
server was started without --admin-token / SPECSERVE_ADMIN_TOKEN the admin API is off: 403):
- GET  /admin/profiles   profiles, weights, fractions, whether reverted to baseline, version.
- PUT  /admin/weights    body {"weights": {name: number}}: replaces all weights (missing names get 0),
                         ends a revert to baseline. 400 for unknown names or fields, a weight that is not a
                         number in [0, 1e9], or an all-zero set; 409 while a staged rollout is running or paused (it owns the weights).
- POST /admin/rollback   revert to baseline: all new traffic (explicit overrides too) to `baseline`;
                         ends a staged rollout as "reverted".
- GET  /admin/rollout    the staged rollout: plan, state, step, weights, last gate figures, history.
- POST /admin/rollout    start one; body: a plan object (see `plan.py`) or {"plan": {...}}. 400 names
                         the bad key; 409 when one is already active.
- POST /admin/rollout/{pause,resume,promote,rollback}   by hand; 409 when no rollout is active
                         (rollback then reverts the traffic to baseline all the same).
Changes apply to the next request; running requests keep the profile they started with.
Every body is parsed as strictly as a generation request (`specserve.server.parsing.parse_json_body`).
The same router serves `specserve serve` and `specserve gateway`.
What it does not do: authentication beyond one shared token, audit storage (changes are logged and
kept in the rollout history).
"""

from __future__ import annotations

import hmac
import logging

from fastapi import APIRouter, Request

from specserve.config import ConfigError
from specserve.inputs import InvalidRequestError
from specserve.rollout.controller import RolloutConflict, RolloutController
from specserve.rollout.plan import plan_from_dict
from specserve.rollout.policy import RolloutPolicy
from specserve.server.errors import APIError
from specserve.server.parsing import parse_json_body

logger = logging.getLogger("specserve.admin")


async def _json_body(request: Request):
    """The body as a JSON object, parsed as strictly as a generation request (depth, NaN, UTF-8); 400 else."""
    try:
        return parse_json_body(await request.body(), what="admin request body")
    except InvalidRequestError as e:
        raise APIError(400, str(e), code=e.code) from None


def _conflict(e: RolloutConflict) -> APIError:
    return APIError(409, str(e), code="rollout_conflict")


def check_admin(request: Request, token: str | None) -> None:
    """Raise the 403 / 401 APIError unless the request carries the admin bearer token."""
    if not token:
        raise APIError(403, "the admin API is disabled: start the server with --admin-token", code="admin_disabled")
    auth = request.headers.get("authorization", "")
    scheme, _, given = auth.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise APIError(
            401, "missing or wrong admin token (send Authorization: Bearer <token>)",
            code="invalid_admin_token", headers={"WWW-Authenticate": "Bearer"},
        )


def admin_router(policy: RolloutPolicy, token: str | None, controller: RolloutController | None = None) -> APIRouter:
    """The /admin routes; without a controller the /admin/rollout routes answer 404."""
    router = APIRouter(prefix="/admin")

    def check(request: Request) -> None:
        check_admin(request, token)

    def need_controller() -> RolloutController:
        if controller is None:
            raise APIError(404, "staged rollouts are not available here", code="rollout_unavailable")
        return controller

    @router.get("/profiles")
    async def get_profiles(request: Request):
        check(request)
        return policy.state()

    @router.put("/weights")
    async def put_weights(request: Request):
        check(request)
        body = await _json_body(request)
        if not isinstance(body, dict) or "weights" not in body:
            raise APIError(400, 'body must be {"weights": {profile: number}}', param="weights")
        unknown = sorted(set(body) - {"weights"})
        if unknown:
            raise APIError(400, f"unknown field(s) {[k[:64] for k in unknown[:5]]}; the body is "
                           '{"weights": {profile: number}}', param=unknown[0][:64])
        try:
            state = controller.set_weights(body["weights"]) if controller else policy.set_weights(body["weights"])
        except ConfigError as e:
            raise APIError(400, str(e), param="weights") from None
        except RolloutConflict as e:
            raise _conflict(e) from None
        logger.warning("admin: weights set to %s (version %d)", state["weights"], state["version"])
        return state

    @router.post("/rollback")
    async def rollback(request: Request):
        check(request)
        if controller is not None:
            controller.revert("reverted by hand (POST /admin/rollback)")
        else:
            policy.revert_to_baseline()
        state = policy.state()
        logger.warning("admin: reverted to baseline (version %d)", state["version"])
        return state

    @router.get("/rollout")
    async def get_rollout(request: Request):
        check(request)
        return need_controller().status()

    @router.post("/rollout")
    async def start_rollout(request: Request):
        check(request)
        ctrl = need_controller()
        body = await _json_body(request)
        if isinstance(body, dict) and set(body) == {"plan"}:
            body = body["plan"]
        try:
            plan = plan_from_dict(body)
            return ctrl.start(plan)
        except ConfigError as e:
            raise APIError(400, f"rollout plan: {e}", param="plan", code="invalid_plan") from None
        except RolloutConflict as e:
            raise _conflict(e) from None

    @router.post("/rollout/{action}")
    async def rollout_action(action: str, request: Request):
        check(request)
        ctrl = need_controller()
        try:
            if action == "pause":
                return ctrl.pause()
            if action == "resume":
                return ctrl.resume()
            if action == "promote":
                return ctrl.promote()
            if action == "rollback":
                return ctrl.revert("reverted by hand (POST /admin/rollout/rollback)")
        except RolloutConflict as e:
            raise _conflict(e) from None
        raise APIError(404, f"unknown rollout action {action!r}; actions: pause, resume, promote, rollback",
                       code="unknown_action")

    return router
