"""Choosing the replica that serves a request: per model a profile of filters, weighted scorers and a picker.

A profile runs in three steps (profile.py): drop the replicas that cannot serve (filters), score the rest in
[0, 1] with each scorer times its weight, let the picker choose. Scorers see the request as routing may read it
(`RoutingRequest`: model, route name, headers, LoRA adapter, the prompt read once per pick; never the whole call)
and a per-replica stats view (what each vLLM reports about itself, scraped by backends/vllm_stats.py, plus this
gateway's own in-flight counts), and a `Note` of their own for this one pick, where they say what they saw
(`outcome`, for the metrics) and keep what they need between `score` and `picked`: a scorer keeps no state of one
pick on itself. Those that learn (`learns = True`: prefix affinity) are told what was picked. The prompt is read
as the request's route declares it (`Route.prompt`). A new plugin is one module and one line in registry.py; its
parameters are a pydantic model it declares, so the policy file's `routing.profiles.*.scorers[].params` is checked
like every other field.
"""

from policies.routing.base import Candidate, Note, Stats
from policies.routing.profile import Profile, build_profile
from policies.routing.registry import FILTERS, PICKERS, SCORERS
from policies.routing.request import RoutingRequest

__all__ = ["Candidate", "Note", "Stats", "Profile", "build_profile", "FILTERS", "PICKERS", "SCORERS",
           "RoutingRequest"]
