"""Knowledge distillation: a student trained against a trained teacher's logits.

With ``distill.teacher_workdir`` set, each example's loss is

    (1 - alpha) * cross_entropy(student, labels) + alpha * T^2 * KL(p_teacher || p_student)

with ``p = softmax(logits / T)`` (Hinton et al.; the ``T^2`` keeps the soft term's gradient
on the scale of the hard one's). The teacher is the run in that workdir: its latest checkpoint
and the config it holds, placed by the student's partitioning rules on the student's mesh. It
runs in the same jitted train step, in inference mode (running BatchNorm statistics), on the
step's normalised images; its logits are a constant of the gradient. Its variables are a
third argument of the train step, beside the state and the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybridpar.config.errors import ConfigError
from hybridpar.runtime import trained


def loss(ce, student_logits, teacher_logits, temperature: float, alpha: float):
    """Per example: ``ce`` (the student's cross-entropy with the labels) mixed with the
    KL divergence of the student's softened distribution from the teacher's."""
    t = temperature
    s = jax.nn.log_softmax(student_logits.astype(jnp.float32) / t)
    p = jax.nn.log_softmax(jax.lax.stop_gradient(teacher_logits).astype(jnp.float32) / t)
    kl = jnp.sum(jnp.exp(p) * (p - s), axis=-1)
    return (1 - alpha) * ce + alpha * t * t * kl


class Teacher:
    """The teacher of ``config`` on ``mesh`` (a ``trained.TrainedRun``): its model,
    variables' shardings and abstract values now; the variables themselves read from its
    checkpoint on first use."""

    def __init__(self, config, mesh):
        d = config.distill
        self.workdir, self.temperature, self.alpha = d.teacher_workdir, d.temperature, d.alpha
        tc = trained.load_config(self.workdir)
        if tuple(tc.data.mean) != tuple(config.data.mean) or tuple(tc.data.std) != tuple(
            config.data.std
        ):
            raise ConfigError(
                f"the teacher in {self.workdir} normalises its images with other data.mean / "
                "data.std than this run: distil on the teacher's data and normalisation"
            )
        if tc.data.num_classes != config.data.num_classes:
            raise ConfigError(
                f"the teacher in {self.workdir} has {tc.data.num_classes} classes, this run "
                f"{config.data.num_classes}: distil a teacher of the same classes"
            )
        # placed like the student's parameters
        self.run = trained.TrainedRun(self.workdir, mesh, config.partitioning, config=tc)
        self.config, self.program, self.model = tc, self.run.program, self.run.model
        self.shardings, self.abstract = self.run.shardings, self.run.abstract

    def variables(self):
        return self.run.variables()

    def logits(self, variables, images):
        """The teacher's logits (float32) for the student's normalised ``images``."""
        x = images.astype(self.program.policy.compute_dtype)
        out = self.model.apply(variables, x, train=False)
        return jax.lax.stop_gradient(out.astype(jnp.float32))

    def mix(self, ce, student_logits, teacher_logits):
        return loss(ce, student_logits, teacher_logits, self.temperature, self.alpha)

    def bind(self, compiled):
        """The compiled ``(state, batch, teacher)`` step as the trainer calls it,
        ``(state, batch)``."""
        return lambda state, batch: compiled(state, batch, self.variables())


def make_teacher(config, mesh) -> Teacher | None:
    return Teacher(config, mesh) if config.distill.teacher_workdir else None
