"""textarena's single-player games as environments (`env: {fn: textarena, args: {game: GuessTheNumber-v0}}`).

The game's raw observations become user messages: its opening prompt first, then after each move the game's
messages (its reply to the move). The episode's reward is the game's reward for player 0 when the game ends.
Each episode's game is seeded from its dataset row (`seed` column if present, else a hash of the prompt), so
the G episodes of a prompt play the same game. Games that need downloads (e.g. Wordle's word lists via nltk)
do not run offline; docs/environments.md lists the ones tested here.
"""

from __future__ import annotations

import hashlib
from typing import Any

from rlora import deadline
from rlora.envs.protocol import EnvironmentFault, StepResult
from rlora.errors import UserError, first_line

GAME_SENDER = -1  # textarena's id of the game's own messages
_STARTED: set[str] = set()  # games this process has seen start for one player
PROBE_TIMEOUT_S = 60.0


def _import_textarena():
    try:
        import textarena  # an optional extra (rlora[envs]), ~2 s to import
    except ImportError:
        raise UserError("env fn 'textarena' needs the textarena package: pip install 'rlora[envs]'") from None
    return textarena


def _row_seed(row: dict[str, Any]) -> int:
    if isinstance(row.get("seed"), int):
        return row["seed"]
    return int(hashlib.sha1(str(row.get("prompt")).encode()).hexdigest()[:8], 16)


class TextArenaEnvironment:
    def __init__(self, game: str = "GuessTheNumber-v0", system_prompt: str | None = None):
        ta = _import_textarena()
        raw = game if game.endswith("-raw") else game + "-raw"  # the game's own messages, no history wrappers
        if raw not in ta.envs.registration.ENV_REGISTRY:
            raise UserError(f"textarena has no game {game!r} (e.g. GuessTheNumber-v0, TowerOfHanoi-v0)")
        self.ta, self.game_id, self.system_prompt = ta, raw, system_prompt
        self.game = None
        if raw not in _STARTED:  # once per game and process: a game that cannot start fails before the model loads
            self._check_starts(game)
            _STARTED.add(raw)

    def _check_starts(self, game: str) -> None:
        """One game for one player, as reset() plays it: a two-player game, or one whose data must be downloaded
        (Wordle's word lists), is refused here rather than failing every episode of the first step."""
        try:  # a game that would download something could hang where there is no network: at most a minute
            with deadline.time_limit(PROBE_TIMEOUT_S, f"did not start within {PROBE_TIMEOUT_S} s"):
                probe = self.ta.make(env_id=self.game_id)
                probe.reset(num_players=1, seed=0)
                player, _observations = probe.get_observation()
        except Exception as err:  # noqa: BLE001 - textarena's own checks (players, downloads): one line
            raise UserError(f"textarena game {game!r} cannot start for one player: {type(err).__name__}: "
                            f"{first_line(err)} (only single-player games that run offline are supported)") from None
        if player != 0:
            raise UserError(f"textarena game {game!r} expects player {player} first: only single-player games are "
                            "supported")

    def reset(self, row: dict[str, Any]) -> list[dict[str, str]]:
        self.game = self.ta.make(env_id=self.game_id)
        self.game.reset(num_players=1, seed=_row_seed(row))
        messages = [{"role": "user", "content": self._game_text()}]
        return ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + messages

    def _game_text(self) -> str:
        player, observations = self.game.get_observation()
        if player != 0:
            raise EnvironmentFault(f"{self.game_id} expects player {player}: only single-player games are supported")
        text = "\n".join(message for sender, message, _kind in observations if sender == GAME_SENDER)
        if not text:
            raise EnvironmentFault(f"{self.game_id} sent no message to the player")
        return text

    def step(self, assistant_text: str) -> StepResult:
        done, _info = self.game.step(action=assistant_text)
        if done:
            rewards, _game_info = self.game.close()
            return StepResult(reward=float((rewards or {}).get(0, 0.0)), done=True)
        return StepResult([{"role": "user", "content": self._game_text()}])
