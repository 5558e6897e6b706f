"""`jaxspec draft train`: offline EAGLE-3 head training on a frozen policy's own rollouts (the
training-time-test loss of `jaxspec.draft`), with checkpoints, resume and export in the public
layout. It sits above `jaxspec.rollout` (it generates); `jaxspec.draft` stays below it."""
