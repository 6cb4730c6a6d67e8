"""Observability: Prometheus metrics (``obs.metrics``), the HTTP endpoint that serves them and the dashboard
(``obs.http``, ``obs.dashboard``), and optional OpenTelemetry spans (``obs.tracing``).

Sits on the ground floor beside ``config`` and ``records``: every layer may record into it, and it imports
nothing above them. It reads no role's state by itself; roles register what they report.
"""
