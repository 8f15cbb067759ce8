"""Sources of replicas: each computes a model's desired endpoints and reports every change.

One small interface (`Source` in base.py): `start(emit)` begins watching and calls `emit(endpoints)` with the
whole desired list each time it changes, from any thread; `stop()` ends it. `kubernetes`: the ready endpoints
of a Service's EndpointSlices; `kserve`: an InferenceService's predictor endpoints while it is Ready; both
list and watch through watch.py, which bounds a dead connection, backs off, and keeps each watch's state
(`watchers()` lists a source's watches for metrics and the admin API). A new
source is one module here and one line in policies/discovery.py. The static source, the policy's `backends:`
list, needs no watch: it is applied to the same live set at load and at every reload (policies/snapshot.py).
"""
