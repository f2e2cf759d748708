"""Verifiers of the reward service. Each module defines one `Verifier` subclass; the app
builds the enabled ones from settings (`services.reward.app.build_verifiers`)."""

from services.reward.verifiers.base import SpecError, Verdict, Verifier

__all__ = ["SpecError", "Verdict", "Verifier"]
