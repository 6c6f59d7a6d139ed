"""Admin HTTP API over the rollout policy and the staged-rollout controller, behind a bearer token.

Endpoints (all need `Authorization: Bearer <token>`; a missing or wrong token is 401, and when the
server was started without --admin-token / SPECSERVE_ADMIN_TOKEN the admin API is off: 403):
- GET  /admin/profiles   profiles, weights, fractions, whether reverted to baseline, version.
- PUT  /admin/weights    body {"weights": {name: number}}: replaces all weights (missing names get 0),
                         ends a revert to baseline. 400 for unknown names or fields, a weight that is not a
                         number in [0, 1e9], or an all-zero set; 409 while a staged rollout is running or paused (it owns the weights).
- POST /admin/profiles   body {"name": str, "config": speculative config or null, "weight": number (default 0)}:
                         adds a profile at run time (201); its proposer is prepared on the engine first
                         (a draft model loaded, the step cost measured for an adaptive schedule). 400 for
                         a bad name, weight or config, 409 when the name exists, 404 where no engine can
                         prepare one (the gateway). Weight 0 = reachable by an explicit override only
                         (a sweep uses it this way).
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
from typing import Any, Awaitable, Callable

from fastapi import APIRouter, Request

from specserve.config import ConfigError, SpeculativeConfig
from specserve.hub import ModelError
from specserve.inputs import InvalidRequestError
from specserve.rollout.controller import RolloutConflict, RolloutController
from specserve.rollout.plan import plan_from_dict
from specserve.rollout.policy import ProfileExists, RolloutPolicy
from specserve.rollout.profiles import MAX_WEIGHT, valid_profile_name
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


def admin_router(policy: RolloutPolicy, token: str | None, controller: RolloutController | None = None,
                 prepare: Callable[[SpeculativeConfig], Awaitable[Any]] | None = None) -> APIRouter:
    """The /admin routes; without a controller the /admin/rollout routes answer 404, without `prepare`
    (which readies a profile added at run time on the engine, raising ConfigError when it cannot)
    POST /admin/profiles does."""
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

    @router.post("/profiles", status_code=201)
    async def add_profile(request: Request):
        check(request)
        if prepare is None:
            raise APIError(404, "adding profiles at run time is not available here", code="profiles_unavailable")
        body = await _json_body(request)
        if not isinstance(body, dict) or "name" not in body or "config" not in body:
            raise APIError(400, 'body must be {"name": str, "config": speculative config or null, "weight": number}',
                           param="name")
        unknown = sorted(set(body) - {"name", "config", "weight"})
        if unknown:
            raise APIError(400, f"unknown key(s) {unknown}; valid: ['name', 'config', 'weight']", param=unknown[0])
        name, weight = body["name"], body.get("weight", 0.0)
        if not isinstance(name, str) or not valid_profile_name(name):
            raise APIError(400, f"profile name {name!r} must be 1-64 characters of letters, digits, _ . -", param="name")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= float(weight) <= MAX_WEIGHT:
            raise APIError(400, f"weight must be a number in [0, {MAX_WEIGHT:g}], got {weight!r}", param="weight")
        if name in policy.profiles:
            raise APIError(409, f"profile {name!r} already exists", param="name", code="profile_exists")
        if weight and controller is not None and controller.active:
            raise APIError(409, "a staged rollout owns the weights while it runs; add the profile with weight 0",
                           param="weight", code="rollout_conflict")
        try:
            spec_config = SpeculativeConfig.from_dict(body["config"])
            if spec_config is not None:
                await prepare(spec_config)  # builds its proposer, loads a draft model, measures the step cost
        except (ConfigError, ModelError) as e:
            raise APIError(400, f"profile {name!r}: {e}", param="config") from None
        except RuntimeError as e:  # e.g. no free KV slot to measure the step cost with
            raise APIError(503, f"profile {name!r} cannot be prepared now: {e}", code="engine_busy",
                           headers={"Retry-After": "5"}) from None
        try:
            state = policy.add_profile(name, spec_config, float(weight))
        except ProfileExists as e:  # added meanwhile by a concurrent call
            raise APIError(409, str(e), param="name", code="profile_exists") from None
        logger.warning("admin: profile %s added: %s (weight %s, version %d)", name,
                       spec_config.to_dict() if spec_config else None, weight, state["version"])
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
