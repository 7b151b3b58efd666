"""What a fine-tune reads of an image tower, one job a module: :mod:`.features` (a forward pass's pooled embedding, patch
grid and logits, and the losses between two readings), :mod:`.augment` (images moved and moved back),
:mod:`.metrics` (k-NN accuracy, cross-size agreement), :mod:`.heads` (a classifier's classes by name, a new head for
the data's) and :mod:`.sizing` (an image processor's output size, and a model read at another size). Used by the
image objectives (:mod:`posextend.training.objectives.image`)."""
