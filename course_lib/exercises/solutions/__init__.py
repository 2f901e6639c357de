"""Solutions of the exercises, one module per chapter, written as a learner would write them
(plain code, not calls into the library), under the names the notebooks use. A notebook shows
one only when asked: ``chNN.solution("N.M")`` prints its source."""
