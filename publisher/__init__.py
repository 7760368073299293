"""The outbox publisher: a sidecar process that delivers committed intents to Kafka.

Run it as ``outbox-publisher``; see ``publisher.cli`` for its settings,
``publisher.app`` for how a publisher is built from them, and
``publisher.loop`` for the state machine of one batch.
"""
