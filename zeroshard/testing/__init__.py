"""What tests, benchmarks and the demo use to run zeroshard: spawning gloo ranks on loopback
(``launch``) and a tiny GPT with synthetic batches (``toy``). Not needed to train."""
