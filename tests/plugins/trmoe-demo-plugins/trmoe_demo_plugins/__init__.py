"""trmoe-demo-plugins: an optimizer, a data source and a route table for trmoe, from outside trmoe."""
