"""The PD system on Ray: worker services and their actors, the controller (membership,
health, restarts, drain), the KV tier actor, the OpenAI-compatible router and its HTTP
app, the ZMQ token stream, metrics, and `pdserve serve`. Knows no model math."""
